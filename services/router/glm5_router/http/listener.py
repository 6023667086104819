"""The HTTP listener: aiohttp's per-connection protocol behind a cap on open connections, with its idle timeout
bounding how long a connection may stay without a complete request header (slowloris), and aiohttp's own
parser errors logged as one line that never quotes the request (a malformed header line can carry an API key)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger(__name__)
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"


class _ParserErrors(logging.Filter):
    """aiohttp logs a request it cannot parse with a traceback whose message quotes the offending line, header
    value included; keep the event, drop the quote."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            what = record.getMessage()
            record.msg = "%s: %s %s (request not quoted: it may hold credentials)"
            record.args = (what, exc.code, type(exc).__name__)
            record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.INFO, "INFO"
        return True


def quiet_parser_errors() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ParserErrors) for f in logger.filters):
        logger.addFilter(_ParserErrors())


@dataclass
class _Count:
    limit: int
    open: int = 0
    refused: int = 0


class _Capped(asyncio.Protocol):
    """Forwards a connection to aiohttp's protocol while fewer than the limit are open; over it, answers 503."""

    def __init__(self, inner: asyncio.Protocol, count: _Count) -> None:
        self.inner: asyncio.Protocol | None = inner
        self.count = count

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.count.open >= self.count.limit:
            self.inner = None
            self.count.refused += 1
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(BUSY)
            transport.close()
            return
        self.count.open += 1
        assert self.inner is not None
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is not None:
            self.count.open -= 1
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


@dataclass
class HttpListener:
    """The HTTP API's listening socket over an AppRunner that was set up (no aiohttp site: this owns the socket)."""

    runner: web.AppRunner
    max_connections: int
    server: asyncio.Server | None = None
    count: _Count = field(init=False)

    def __post_init__(self) -> None:
        self.count = _Count(self.max_connections)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Listen; returns the port (the bound one when `port` is 0)."""
        handler = self.runner.server
        assert handler is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Capped(handler(), self.count), host, port,
                                               ssl=ssl_context, reuse_address=True)  # fmt: skip
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def open_connections(self) -> int:
        return self.count.open

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()  # no new connections; the runner's cleanup ends the open ones
            self.server = None


__all__ = ["HttpListener", "quiet_parser_errors"]
