"""What every glm5 gRPC server does the same way: message limits, health checking, reflection, binding, and
GenerateStream (many Generate requests multiplexed over one stream)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from glm5.errors import BindError, ConfigError, bounded
from glm5.security import NO_TLS, TlsConfig, add_port
from glm5.v1 import worker_pb2

MESSAGE_LIMIT = 64 << 20  # what a server sends (prompt logprobs of a long prompt are large)
# what a server accepts in one message: a request is a prompt (a 1M-token prompt is ~5 MB of ids); callers batch
# below REQUEST_BATCH_BYTES, and a larger message is refused before it is read into memory
RECEIVE_LIMIT = 16 << 20
REQUEST_BATCH_BYTES = 4 << 20
# Initial metadata a server sends on a client-streaming call it has accepted: the client writes only after it
# (a refusal before any read then reaches the client as its status, not as a write failing against it)
STREAM_ACCEPTED_KEY = "glm5-stream-accepted"
log = logging.getLogger(__name__)


def freeze_heap() -> None:
    """Takes everything alive once a server has started (imported modules, the model, compiled graphs) out of the
    cyclic garbage collector's reach. A full collection otherwise walks those ~180K objects holding the GIL: 80-100
    ms on an idle 2-core machine, up to 270 ms with busy cores, a stall that every token stream and health check
    in the process feels. Later collections walk only what was made after this call. (vLLM does the same.)"""
    gc.collect()
    gc.freeze()


class Health(HealthServicer):  # type: ignore[misc]
    """grpc.health.v1 with List. grpcio-health-checking's asyncio servicer has Check and Watch only, so a List
    call reached the generated base class, whose NotImplementedError grpc logged as an ERROR traceback."""

    async def List(self, request: health_pb2.HealthListRequest,
                   context: grpc.aio.ServicerContext) -> health_pb2.HealthListResponse:  # fmt: skip
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in self._server_status.items()}
        )


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one connection may hold on a gRPC listener (docs/security.md, "Connections"): a client that connects
    and never finishes its handshake, or keeps a connection open with no call on it, cannot pin it for long, and
    the listener refuses connections past its cap (closed at accept)."""

    handshake_timeout_s: float = 10.0  # TCP accept to a complete HTTP/2 (and TLS) handshake
    idle_timeout_s: float = 300.0  # a connection without a call for this long is closed (GOAWAY; clients reconnect)
    max_connections: int = 1024

    def __post_init__(self) -> None:
        if min(self.handshake_timeout_s, self.idle_timeout_s) <= 0 or self.max_connections < 1:
            raise ConfigError("--grpc-handshake-timeout and --grpc-idle-timeout must be > 0, --grpc-max-connections "
                              ">= 1")  # fmt: skip

    def options(self) -> list[tuple[str, int]]:
        return [("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", int(self.idle_timeout_s * 1000)),
                ("grpc.max_allowed_incoming_connections", self.max_connections)]  # fmt: skip


DEFAULT_CONNECTIONS = ConnectionLimits()


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULT_CONNECTIONS
    g = p.add_argument_group("gRPC connections (docs/security.md)")
    g.add_argument("--grpc-handshake-timeout", type=float, default=d.handshake_timeout_s,
                   help="seconds from accepting a connection to its completed handshake")  # fmt: skip
    g.add_argument("--grpc-idle-timeout", type=float, default=d.idle_timeout_s,
                   help="seconds a connection may stay open without a call")  # fmt: skip
    g.add_argument("--grpc-max-connections", type=int, default=d.max_connections,
                   help="open connections; more are closed as they are accepted")  # fmt: skip


def connection_limits_from_args(a: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(a.grpc_handshake_timeout, a.grpc_idle_timeout, a.grpc_max_connections)


def new_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
               limits: ConnectionLimits = DEFAULT_CONNECTIONS) -> grpc.aio.Server:  # fmt: skip
    return grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", RECEIVE_LIMIT),
            ("grpc.max_send_message_length", MESSAGE_LIMIT),
            # gRPC's default lets a second server bind the same port and take half its connections silently
            ("grpc.so_reuseport", 0),
            *limits.options(),
        ],
    )


async def start_serving(
    server: grpc.aio.Server,
    service_name: str,
    add_service: Callable[[grpc.aio.Server], None],
    host: str,
    port: int,
    tls: TlsConfig = NO_TLS,
    service_ready: bool = True,
    loading: bool = False,
) -> tuple[HealthServicer, int]:
    """Adds the service, grpc.health.v1 and reflection, binds host:port (0: any free port; TLS when `tls` is on),
    starts, and reports SERVING for "" (the process is alive: liveness) and for the service unless `service_ready`
    is False (NOT_SERVING until the caller sets it: readiness probes ask for the service by name). `loading`: ""
    and the service both say NOT_SERVING until the caller sets them (a worker that binds its port before it loads
    its model: the kubelet's startup and readiness probes of a worker ask for ""). Returns the health servicer (for
    graceful shutdown and those later sets) and the bound port. A port that cannot be bound is a BindError naming
    it."""
    add_service(server)
    health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((service_name, health_name, reflection.SERVICE_NAME), server)
    try:
        bound = add_port(server, f"{host}:{port}", tls)
    except RuntimeError:  # grpc raises this (no errno) when the address is taken or not local
        bound = 0
    if bound == 0:
        raise BindError(f"cannot listen on {host}:{port} (gRPC): the port is in use or the address is not on this host")
    status = health_pb2.HealthCheckResponse
    await health.set(service_name, status.SERVING if service_ready and not loading else status.NOT_SERVING)
    if loading:  # the servicer starts with "" SERVING
        await health.set("", status.NOT_SERVING)
    await server.start()
    if not loading:
        await health.set("", status.SERVING)
    return health, bound


async def start_health_server(health: HealthServicer, host: str, port: int) -> grpc.aio.Server:
    """grpc.health.v1 alone, in plain text, on its own port: Kubernetes' gRPC probes cannot speak TLS, so a server
    whose API port wants mutual TLS answers its probes here (it reveals only SERVING or NOT_SERVING)."""
    server = new_server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise BindError(
            f"cannot listen on {host}:{port} (health): the port is in use or the address is not on this host"
        )
    await server.start()
    return server


class RequestFailed(Exception):
    """One request ended with this status. On Generate it is the call's status; on GenerateStream only that
    request ends (with error_code) and the stream goes on."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        message = bounded(message)  # it travels in gRPC trailers, which hold a few KiB
        super().__init__(message)
        self.code = code
        self.message = message


OneRequest = Callable[[worker_pb2.GenerateRequest], AsyncIterator[worker_pb2.GenerateResponse]]
# A batch closes at either bound (a message must stay far below MESSAGE_LIMIT: prompt logprobs can be large).
BATCH_LIMIT = 256  # responses per GenerateStreamResponses
BATCH_BYTES = 4 << 20


def merge_response(into: worker_pb2.GenerateResponse, more: worker_pb2.GenerateResponse) -> bool:
    """Appends `more` (the next response of the same request) to `into`, as one message would have carried both;
    False, leaving both alone, when they cannot be one message (different weight versions, or `into` ended)."""
    if into.finish_reason or into.weight_version != more.weight_version:
        return False
    text = into.text + more.text
    into.MergeFrom(more)  # repeated fields append; set scalars (finish_reason, usage, stop_reason) take `more`'s
    into.text = text
    return True


async def serve_multiplexed(
    one: OneRequest, requests: AsyncIterator[worker_pb2.GenerateStreamRequests]
) -> AsyncIterator[worker_pb2.GenerateStreamResponses]:
    """Worker.GenerateStream from a Generate implementation (`one`): each started request runs as its own task and
    its responses are interleaved onto the stream as they come; `cancel` and the end of the stream stop them.
    Whatever is ready when the stream can take the next message goes out as one batch, a request's responses in it
    merged into one (what a slow reader of Generate would have got)."""
    out: asyncio.Queue[worker_pb2.GenerateStreamResponse | None] = asyncio.Queue()
    tasks: dict[int, asyncio.Task[None]] = {}

    def fail(rid: int, code: grpc.StatusCode, message: str) -> None:
        out.put_nowait(worker_pb2.GenerateStreamResponse(id=rid, error_code=code.value[0], error_message=message))

    async def run(rid: int, request: worker_pb2.GenerateRequest) -> None:
        try:
            async for resp in one(request):
                out.put_nowait(worker_pb2.GenerateStreamResponse(id=rid, response=resp))
        except RequestFailed as exc:
            fail(rid, exc.code, exc.message)
        except Exception as exc:  # one request's bug must not end the others on the stream
            log.exception("request %d on a GenerateStream failed", rid)
            fail(rid, grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        finally:
            tasks.pop(rid, None)

    async def read() -> None:
        try:
            async for batch in requests:
                for msg in batch.requests:
                    action = msg.WhichOneof("action")
                    if action == "start":
                        if msg.id in tasks:
                            fail(
                                msg.id, grpc.StatusCode.INVALID_ARGUMENT, f"id: {msg.id} is already open on this stream"
                            )
                        else:
                            tasks[msg.id] = asyncio.create_task(run(msg.id, msg.start))
                    elif action == "cancel":
                        task = tasks.get(msg.id)
                        if task is not None:
                            task.cancel()
                    else:
                        fail(msg.id, grpc.StatusCode.INVALID_ARGUMENT, "action: give start or cancel")
            if tasks:  # the caller half-closed: finish what is open, then end the stream
                await asyncio.gather(*tasks.values(), return_exceptions=True)
        finally:
            out.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        ended = False
        while not ended:
            item = await out.get()
            batch = worker_pb2.GenerateStreamResponses()
            last: dict[int, worker_pb2.GenerateStreamResponse] = {}  # each id's last entry in this batch
            size = 0
            while item is not None:
                size += item.ByteSize()
                prev = last.get(item.id)
                if not (prev is not None and not prev.error_code and not item.error_code
                        and merge_response(prev.response, item.response)):  # fmt: skip
                    batch.responses.append(item)
                    last[item.id] = batch.responses[-1]
                if len(batch.responses) >= BATCH_LIMIT or size >= BATCH_BYTES or out.empty():
                    break
                item = out.get_nowait()
            ended = item is None
            if batch.responses:
                yield batch
        await reader
    finally:
        reader.cancel()
        for task in list(tasks.values()):
            task.cancel()
