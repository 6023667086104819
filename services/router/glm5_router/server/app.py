"""The router process: worker pool, queues, dispatcher, the gRPC service and the HTTP API, and a graceful
stop (health NOT_SERVING, running streams finish within the grace period)."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from aiohttp import web
from glm5.crypto.sm4 import KeyRing
from glm5.errors import ConfigError
from glm5.serving import new_server, start_serving
from glm5.v1 import router_pb2, router_pb2_grpc
from grpc_health.v1._async import HealthServicer
from redis.exceptions import RedisError

from glm5_router.config import RouterConfig
from glm5_router.frontend import Frontend
from glm5_router.http.openai_api import OpenAIServer
from glm5_router.scheduling.dispatcher import Dispatcher
from glm5_router.scheduling.queues import InProcessQueues
from glm5_router.scheduling.redis_queue import RedisSettings, SharedQueue
from glm5_router.server.grpc_service import RouterService
from glm5_router.telemetry import Telemetry, configure_tracing
from glm5_router.workers.pool import WorkerPool

log = logging.getLogger(__name__)
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


@dataclass
class RouterApp:
    config: RouterConfig
    pool: WorkerPool
    dispatcher: Dispatcher
    frontend: Frontend
    grpc_server: grpc.aio.Server
    health: HealthServicer
    http_runner: web.AppRunner
    grpc_port: int
    http_port: int
    shared: SharedQueue | None = None

    async def stop(self, grace: float = 10.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        await self.http_runner.cleanup()
        if self.shared is not None:
            await self.shared.close(grace)  # stop claiming; claimed requests finish
        await self.dispatcher.close()
        await self.pool.close()


async def start_router(config: RouterConfig) -> RouterApp:
    keys = KeyRing.from_dir(config.sm4_key_dir) if config.sm4_key_dir else None
    configure_tracing()
    telemetry = Telemetry()
    pool = WorkerPool(config)
    pool.on_breaker = lambda address, state, reason: telemetry.transitions.labels(address, state.value).inc()
    queues = InProcessQueues(config.max_queued)
    dispatcher = Dispatcher(config, pool, queues, telemetry)
    telemetry.watch(
        queues.depth, lambda: {a: (w.breaker.current().value, w.healthy, w.stats) for a, w in pool.workers.items()}
    )
    frontend = Frontend(config, pool, dispatcher)
    await pool.start()
    dispatcher.start()
    shared = None
    if config.redis_url:
        shared = SharedQueue(RedisSettings(config.redis_url), dispatcher, pool, config.max_queued,
                             config.long_pause_kv_usage)  # fmt: skip
        try:
            await shared.start()
        except (OSError, RedisError) as exc:
            await dispatcher.close()
            await pool.close()
            raise ConfigError(f"--redis-url: cannot reach {config.redis_url}: {exc}") from exc
        frontend.submit = shared.submit

    server = new_server()
    service = RouterService(frontend, keys)

    def add(s: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(service, s)  # type: ignore[no-untyped-call]

    health, grpc_port = await start_serving(server, SERVICE_NAME, add, config.host, config.grpc_port)

    runner = web.AppRunner(OpenAIServer(frontend).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.http_port)
    await site.start()
    http_port = runner.addresses[0][1] if runner.addresses else config.http_port
    log.info("router: gRPC on %s:%d, OpenAI HTTP on http://%s:%d/v1, workers %s", config.host, grpc_port,
             config.host, http_port, list(pool.workers))  # fmt: skip
    return RouterApp(config, pool, dispatcher, frontend, server, health, runner, grpc_port, http_port, shared)


async def serve_until_signal(config: RouterConfig, grace: float = 10.0) -> None:
    app = await start_router(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("router stopping (grace %.0fs)", grace)
    await app.stop(grace)
