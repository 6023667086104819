"""The worker process: gRPC server with health checking, reflection and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from glm5.serving import new_server, start_serving
from glm5.v1 import worker_pb2, worker_pb2_grpc
from grpc_health.v1._async import HealthServicer

from glm5_worker.config import EngineConfig
from glm5_worker.engine.async_engine import AsyncEngine
from glm5_worker.engine.engine import Engine
from glm5_worker.server.service import WorkerService

log = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
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


@dataclass(slots=True)
class WorkerServer:
    server: grpc.aio.Server
    engine: AsyncEngine
    health: HealthServicer
    port: int

    async def stop(self, grace: float) -> None:
        """Reports NOT_SERVING, lets running requests finish within `grace`, then stops."""
        await self.health.enter_graceful_shutdown()
        await self.engine.drain(grace)
        await self.server.stop(1.0)
        self.engine.shutdown()


async def start_worker(config: EngineConfig, host: str = "0.0.0.0", port: int = 50051) -> WorkerServer:
    engine = AsyncEngine(await asyncio.to_thread(Engine, config))
    server = new_server([RequestIdInterceptor()])
    service = WorkerService(engine)

    def add(s: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServicer_to_server(service, s)  # type: ignore[no-untyped-call]

    health, bound = await start_serving(server, SERVICE_NAME, add, host, port)
    log.info("worker serving %s on %s:%d", engine.engine.served_model_name, host, bound)
    return WorkerServer(server, engine, health, bound)


async def serve_until_signal(config: EngineConfig, host: str, port: int, grace: float, **_: Any) -> None:
    worker = await start_worker(config, host, port)
    print(f"glm5 worker listening on {host}:{worker.port} (model {worker.engine.engine.served_model_name})",
          flush=True)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining for up to %.0fs", grace)
    await worker.stop(grace)
