"""How a completion or chat request answers, written once for both: every choice's deltas either streamed as
server-sent events as they come, or collected into one JSON body; either way a request's choices run together
and one failing stops the others."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from aiohttp import web
from glm5.v1 import worker_pb2

from glm5_router.frontend import Delta
from glm5_router.http import params as fields
from glm5_router.http.errors import to_api_error
from glm5_router.http.formatting import FINISH, usage_json

log = logging.getLogger(__name__)
# JSON allows these raw inside strings, but line-splitting SSE clients (JavaScript, some Python) break on them
LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})
T = TypeVar("T")
Chunk = Callable[[int, Delta], dict[str, Any] | None]  # a streamed choice for (choice index, delta); None: nothing
Collect = Callable[[int, AsyncIterator[Delta]], Coroutine[Any, Any, tuple[dict[str, Any], worker_pb2.GenerateResponse]]]


async def respond(
    request: web.Request,
    request_id: str,
    body: dict[str, Any],
    streams: list[AsyncIterator[Delta]],
    n: int,
    response_id: str,
    model: str,
    objects: tuple[str, str],
    chunk: Chunk,
    collect: Collect,
    opening: Sequence[dict[str, Any]] = (),
) -> web.StreamResponse:
    """The answer to a request whose choices are `streams` (n per prompt). `stream: true`: SSE, each event of
    `object` objects[0] with one choice from `chunk` (`opening` choices first); else one JSON body of `object`
    objects[1], the choices `collect` makes of each stream (with each choice's last response, for the usage)."""
    created = int(time.time())
    if fields.get(body, "stream", bool, False):
        head = {"id": response_id, "object": objects[0], "created": created, "model": model}
        return await stream_sse(request, request_id, streams, head, body, n, chunk, opening)
    done = await gather_choices([collect(i, s) for i, s in enumerate(streams)])
    usage = usage_json({i: r for i, (_, r) in enumerate(done)}, n)
    return web.json_response({"id": response_id, "object": objects[1], "created": created, "model": model,
                              "choices": [c for c, _ in done], "usage": usage})  # fmt: skip


async def stream_sse(
    request: web.Request,
    request_id: str,
    streams: list[AsyncIterator[Delta]],
    head: dict[str, Any],
    body: dict[str, Any],
    n: int,
    chunk: Chunk,
    opening: Sequence[dict[str, Any]] = (),
) -> web.StreamResponse:
    """The SSE answer: `opening` choices first, then `chunk(i, delta)` (None: nothing to send) for each choice's
    deltas as they come, the usage chunk if asked, errors as an error event, then [DONE]. The streams start (the
    first token or an error) before the 200 goes out."""
    streams = await _primed_all(streams)
    sse = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await sse.prepare(request)
    for first in opening:
        await _send(sse, {**head, "choices": [first]})
    finals: dict[int, worker_pb2.GenerateResponse] = {}
    try:
        async for i, d in _merged(streams):
            choice = chunk(i, d)
            if choice is not None:
                await _send(sse, {**head, "choices": [choice]})
            if FINISH.get(d.response.finish_reason):
                finals[i] = d.response
        if len(finals) == len(streams) and (body.get("stream_options") or {}).get("include_usage"):
            await _send(sse, {**head, "choices": [], "usage": usage_json(finals, n)})
    except ConnectionError:  # the client left: its requests are cancelled as the streams close
        log.info("client %s left request %s", request.remote, request_id)
        return sse
    except Exception as exc:
        await _send(sse, to_api_error(exc).body())
    await sse.write(b"data: [DONE]\n\n")
    return sse


def sse_event(payload: dict[str, Any]) -> bytes:
    text = json.dumps(payload, ensure_ascii=False)
    if not text.isascii():
        text = text.translate(LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


async def _send(sse: web.StreamResponse, payload: dict[str, Any]) -> None:
    await sse.write(sse_event(payload))


async def gather_choices(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Runs a request's choices together; one failing cancels the others (their workers stop generating)."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) as each choice's deltas arrive; the first error ends them all."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for d in stream:
                await queue.put((i, d))
            await queue.put((i, None))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _primed_all(streams: list[AsyncIterator[Delta]]) -> list[AsyncIterator[Delta]]:
    """_primed for every choice at once; if one fails before its first delta, the others are closed."""
    if len(streams) == 1:
        return [await _primed(streams[0])]
    tasks = [asyncio.ensure_future(_primed(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]  # an async generator: its request is cancelled
        raise


async def _primed(stream: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """Wait for the first delta before the SSE headers go out, so queue-full, deadline and unavailable
    errors still get their HTTP status (429 / 408 / 503) instead of a 200 with an error event."""
    it = aiter(stream)
    try:
        first = await anext(it)
    except StopAsyncIteration:
        first = None

    async def chained() -> AsyncIterator[Delta]:
        if first is not None:
            yield first
        async for d in it:
            yield d

    return chained()
