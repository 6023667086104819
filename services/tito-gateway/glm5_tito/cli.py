"""`glm5 tito-gateway`: flags -> GatewayConfig -> the gateway's gRPC server (server.py) until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from glm5.rl.buffer import InProcessBuffer, RedisBuffer, RolloutBuffer
from glm5.security import (
    LOOPBACK,
    add_internal_token_arguments,
    add_tls_arguments,
    internal_token_from_args,
    tls_from_args,
)
from glm5.serving import (
    add_connection_arguments,
    connection_limits_from_args,
    freeze_heap,
)
from glm5.settings import add_flags, from_flags

from glm5_tito.gateway import GatewayConfig
from glm5_tito.server import start_gateway

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, GatewayConfig)  # the gateway's settings; what follows is this process's and the derived ones
    p.add_argument("--host", default=LOOPBACK, help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=50060, help="gRPC port (glm5.v1.TitoGateway)")
    p.add_argument("--redis-url", help="rollout buffer as a Redis stream (default: in-process)")
    add_tls_arguments(p)
    add_connection_arguments(p)
    add_internal_token_arguments(p)


def config_from_args(a: argparse.Namespace) -> GatewayConfig:
    return from_flags(GatewayConfig, a, tls=tls_from_args(a), connections=connection_limits_from_args(a),
                      internal_token=internal_token_from_args(a))  # fmt: skip


def run(a: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(a)

    async def main() -> None:
        buffer: RolloutBuffer = RedisBuffer(a.redis_url) if a.redis_url else InProcessBuffer()
        server, gateway, _ = await start_gateway(config, buffer, a.host, a.port)
        freeze_heap()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(5.0)
        await gateway.close()

    asyncio.run(main())
