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
from glm5.errors import BindError, ConfigError
from glm5.security import ApiKeyInterceptor, redact_url
from glm5.serving import freeze_heap, new_server, start_health_server, start_serving
from glm5.v1 import router_pb2, router_pb2_grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer
from redis.exceptions import RedisError

from glm5_router.config import RouterConfig
from glm5_router.frontend import Frontend
from glm5_router.http.listener import HttpListener, quiet_parser_errors
from glm5_router.http.openai_api import OpenAIServer
from glm5_router.scheduling.dispatcher import Dispatcher
from glm5_router.scheduling.queues import InProcessQueues
from glm5_router.scheduling.redis_queue import RedisSettings, SharedQueue
from glm5_router.server.grpc_service import RouterService
from glm5_router.telemetry import Telemetry, WorkerSnapshot, configure_tracing
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
    http_listener: HttpListener
    grpc_port: int
    http_port: int
    shared: SharedQueue | None = None
    health_server: grpc.aio.Server | None = None
    readiness: asyncio.Task[None] | None = None

    async def stop(self, grace: float = 10.0) -> None:
        if self.shared is not None:
            self.shared.closing = True  # the requests cut short by the stop stay queued for the clients' return
        if self.readiness is not None:
            self.readiness.cancel()
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(None)
        await self.http_listener.close()
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
        queues.depth,
        lambda: {
            a: WorkerSnapshot(w.breaker.current().value, w.healthy, w.stats, w.outstanding_tokens, w.in_flight)
            for a, w in pool.workers.items()
        },
    )
    if pool.cache_index is not None:
        telemetry.watch_cache(pool.cache_index, dispatcher.picker.routed)
    frontend = Frontend(config, pool, dispatcher)
    await pool.start()
    dispatcher.start()
    shared = None
    if config.redis_url:
        settings = RedisSettings(config.redis_url, claims_per_worker=config.redis_claims_per_worker,
                                 no_worker_timeout_s=config.no_worker_timeout_s)  # fmt: skip
        shared = SharedQueue(settings, dispatcher, pool, config.max_queued, config.long_pause_kv_usage)
        try:
            await shared.start()
        except (OSError, RedisError) as exc:
            await dispatcher.close()
            await pool.close()
            raise ConfigError(f"--redis-url: cannot reach {redact_url(config.redis_url)}: {exc}") from None
        frontend.submit = shared.submit

    server = new_server([ApiKeyInterceptor(config.api_keys)] if config.api_keys else [], config.grpc_connections)
    health_server: grpc.aio.Server | None = None
    service = RouterService(frontend, keys, config.require_sealed, config.replay_window_s,
                            shared.claim if shared is not None else None,
                            replay_skew_s=config.replay_skew_s)  # fmt: skip

    def add(s: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(service, s)  # type: ignore[no-untyped-call]

    http = OpenAIServer(frontend, config.api_keys, config.require_sealed, max_body=config.max_request_bytes,
                        public_metrics=config.public_metrics, public_health_details=config.public_health_details,
                        body_timeout_s=config.http_body_timeout_s)  # fmt: skip
    # handler_cancellation: a client that disconnects cancels its handler, and with it its requests on the workers
    # (streaming or not). keepalive_timeout: aiohttp arms it when a connection opens and after each response, and
    # closes the connection if no complete request header came by then (idle and slowloris alike)
    runner = web.AppRunner(http.app(), access_log=None, handler_cancellation=True,
                           keepalive_timeout=config.http_idle_timeout_s)  # fmt: skip
    quiet_parser_errors()
    listener = HttpListener(runner, config.http_max_connections)
    try:
        # The router service (what readiness probes ask for) is SERVING only once a worker answered with its
        # tokenizer: before that every API call is a 503. "" (liveness) is SERVING from the start.
        health, grpc_port = await start_serving(server, SERVICE_NAME, add, config.host, config.grpc_port, config.tls,
                                                service_ready=pool.ready)  # fmt: skip
        if config.health_port is not None:
            health_server = await start_health_server(health, config.host, config.health_port)
        await runner.setup()
        ssl_context = config.http_tls.ssl_context() if config.http_tls.enabled else None
        try:
            http_port = await listener.start(config.host, config.http_port, ssl_context)
        except OSError as exc:
            raise BindError(f"cannot listen on {config.host}:{config.http_port} (HTTP): {exc.strerror}") from None
    except BaseException:
        await server.stop(None)
        if health_server is not None:
            await health_server.stop(None)
        await listener.close()
        await runner.cleanup()
        if shared is not None:
            await shared.close(0)
        await dispatcher.close()
        await pool.close()
        raise
    scheme = "https" if config.http_tls.enabled else "http"
    log.info("router: gRPC%s on %s:%d, OpenAI HTTP on %s://%s:%d/v1%s, workers %s",
             " (TLS)" if config.tls.enabled else "", config.host, grpc_port, scheme, config.host, http_port,
             " (API keys required)" if config.api_keys else "", list(pool.workers))  # fmt: skip
    readiness = None if pool.ready else asyncio.create_task(_serving_when_ready(pool, health))
    return RouterApp(config, pool, dispatcher, frontend, server, health, runner, listener, grpc_port, http_port,
                     shared, health_server, readiness)  # fmt: skip


async def _serving_when_ready(pool: WorkerPool, health: HealthServicer) -> None:
    await pool.wait_ready(None)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    log.info("router: ready (a worker answered)")


async def serve_until_signal(config: RouterConfig, grace: float = 10.0) -> None:
    app = await start_router(config)
    freeze_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("router stopping (grace %.0fs)", grace)
    await app.stop(grace)
