"""The worker process: gRPC server with health checking, reflection and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from glm5.security import (
    LOOPBACK,
    NO_ADMIN,
    NO_TLS,
    AdminInterceptor,
    AdminPolicy,
    InternalTokenInterceptor,
    Secret,
    TlsConfig,
    is_loopback,
    rejecting,
)
from glm5.serving import (
    DEFAULT_CONNECTIONS,
    ConnectionLimits,
    freeze_heap,
    new_server,
    start_health_server,
    start_serving,
)
from glm5.v1 import worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from glm5_worker.config import EngineConfig
from glm5_worker.engine.async_engine import AsyncEngine
from glm5_worker.engine.engine import Engine
from glm5_worker.resolved import resolve
from glm5_worker.server.push import clear_staging
from glm5_worker.server.service import WorkerService

log = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
ADMIN_METHODS = (
    f"/{SERVICE_NAME}/UpdateWeights",
    f"/{SERVICE_NAME}/PushWeights",
    f"/{SERVICE_NAME}/SyncWeights",
)  # the RPCs that change what the worker serves
LOST_LINGER_S = 2.0
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Puts the caller's x-request-id metadata in a context variable, for logs."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "x-request-id":
                request_id_var.set(str(value))
        return await continuation(handler_call_details)


class LoadingGate(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Worker RPCs answer UNAVAILABLE until open(): the port is bound before the model loads (so a taken port fails
    at once), and a caller retries, or a router keeps polling, until the worker serves. Health and reflection answer
    all along."""

    def __init__(self) -> None:
        self.is_open = False

    def open(self) -> None:
        self.is_open = True

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if self.is_open or handler is None or not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        return rejecting(handler, grpc.StatusCode.UNAVAILABLE, "the worker is loading its model; retry shortly")


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """Who may reach the worker and how: TLS (mutual with a CA), the internal token every call but health checks
    must carry (None: any caller, for local development only), the admin policy of UpdateWeights on top of it, and
    the only directory UpdateWeights may load from (None: it is refused)."""

    tls: TlsConfig = NO_TLS
    admin: AdminPolicy = NO_ADMIN
    weights_root: Path | None = None
    health_port: int | None = None  # plain-text health checks on their own port (for probes, when TLS is on)
    internal_token: Secret | None = None
    connections: ConnectionLimits = DEFAULT_CONNECTIONS  # what one connection to the worker may hold


@dataclass(slots=True)
class WorkerServer:
    server: grpc.aio.Server
    engine: AsyncEngine
    health: HealthServicer
    port: int
    lost: asyncio.Event  # set once the replica failed: the worker must exit non-zero
    health_server: grpc.aio.Server | None = None

    async def stop(self, grace: float) -> None:
        """Reports NOT_SERVING, lets running requests finish within `grace`, then stops."""
        await self.health.enter_graceful_shutdown()
        await self.engine.drain(grace)
        await self.server.stop(1.0)
        if self.health_server is not None:
            await self.health_server.stop(None)
        self.engine.shutdown()


async def start_worker(
    config: EngineConfig, host: str = LOOPBACK, port: int = 50051, security: ServerSecurity = ServerSecurity()
) -> WorkerServer:
    """Checks the model and the flags, binds the port, then loads the model (health says NOT_SERVING and the
    Worker RPCs UNAVAILABLE meanwhile) and serves: a busy port or a bad model path fails in a second or two, not
    after the load. Decode steps compile after that in the background (AsyncEngine), the worker serving eagerly."""
    loop = asyncio.get_running_loop()
    lost = asyncio.Event()
    holder: list[HealthServicer] = []

    def on_fatal(reason: str) -> None:  # on the engine thread
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(_not_serving(holder, lost)))

    model = resolve(config)  # the checkpoint's config and every flag, before anything binds or loads
    engine = AsyncEngine(functools.partial(Engine, config, compile_now=False), on_fatal, begin=False)
    gate = LoadingGate()
    # the internal token first: a call without it is refused before anything else looks at it
    token = [InternalTokenInterceptor(security.internal_token)] if security.internal_token is not None else []
    server = new_server(
        [*token, gate, RequestIdInterceptor(), AdminInterceptor(ADMIN_METHODS, security.admin)], security.connections
    )
    clear_staging(security.weights_root)
    service = WorkerService(engine, security.weights_root)

    def add(s: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServicer_to_server(service, s)  # type: ignore[no-untyped-call]

    health, bound = await start_serving(server, SERVICE_NAME, add, host, port, security.tls, loading=True)
    holder.append(health)
    health_server = None
    try:
        if security.health_port is not None:
            health_server = await start_health_server(health, host, security.health_port)
        log.info("listening on %s:%d; loading %s", host, bound, model.model_dir)
        engine.begin()
        await engine.started()
        await service.prime()
    except BaseException:
        await server.stop(None)
        if health_server is not None:
            await health_server.stop(None)
        engine.shutdown()
        raise
    gate.open()
    if engine.fatal is None:
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("worker serving %s on %s:%d%s%s", engine.info.served_model_name, host, bound,
             " over TLS" if security.tls.enabled else "",
             ", internal token required" if security.internal_token is not None else "")  # fmt: skip
    if security.internal_token is None and not is_loopback(host):
        log.warning("no --internal-token-file / --internal-token-env: any process that reaches %s:%d may call this "
                    "worker (for local development only)", host, bound)  # fmt: skip
    return WorkerServer(server, engine, health, bound, lost, health_server)


async def _not_serving(holder: list[HealthServicer], lost: asyncio.Event) -> None:
    """The replica is lost: health checks (the readiness and liveness probes) fail from now on."""
    for health in holder:
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    lost.set()


async def serve_until_signal(
    config: EngineConfig, host: str, port: int, grace: float, security: ServerSecurity = ServerSecurity(), **_: Any
) -> int:
    """Serves until SIGINT/SIGTERM (exit code 0) or until the replica is lost (exit code 1: Kubernetes then
    restarts the pod, and with it every rank)."""
    worker = await start_worker(config, host, port, security)
    freeze_heap()
    print(f"glm5 worker listening on {host}:{worker.port} (model {worker.engine.info.served_model_name})",
          flush=True)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped, lost = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(worker.lost.wait())
    await asyncio.wait([stopped, lost], return_when=asyncio.FIRST_COMPLETED)
    if worker.lost.is_set():
        log.error("replica lost (%s): exiting", worker.engine.fatal)
        # the requests in flight have already ended UNAVAILABLE; for a moment health checks say NOT_SERVING
        # (routers stop picking this worker) and the last messages leave, then the process exits
        await asyncio.sleep(LOST_LINGER_S)
        await worker.server.stop(1.0)
        worker.engine.shutdown()
        return 1
    log.info("shutting down: draining for up to %.0fs", grace)
    await worker.stop(grace)
    return 0
