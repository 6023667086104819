"""`glm5 tito-gateway`: flags -> GatewayConfig -> the gateway's gRPC server (server.py) until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from glm5.errors import ConfigError
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

from glm5_tito.gateway import GatewayConfig
from glm5_tito.server import start_gateway

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = GatewayConfig(engines=())
    p.add_argument("--engine", action="append", default=[], help="rollout engine (worker) host:port, repeatable")
    p.add_argument("--engine-dns", help="host:port of a headless Service; every A record is a rollout engine")
    p.add_argument("--host", default=LOOPBACK, help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=50060, help="gRPC port (glm5.v1.TitoGateway)")
    p.add_argument("--tokenizer-fingerprint", help="sha256 every engine must report (default: the first engine's)")
    p.add_argument("--virtual-nodes", type=int, default=d.vnodes, help="ring points per rank")
    p.add_argument("--virtual-node-reserve", type=float, default=d.virtual_node_reserve,
                   help="share of virtual nodes held back on the hash ring for under-loaded ranks")  # fmt: skip
    p.add_argument("--load-bound", type=float, default=d.load_bound, help="no rank above ceil(c * load / ranks)")
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_s,
                   help="seconds between model-info checks of each engine (3 misses remove the rank)")  # fmt: skip
    p.add_argument("--redis-url", help="rollout buffer as a Redis stream (default: in-process)")
    add_tls_arguments(p)
    add_connection_arguments(p)
    add_internal_token_arguments(p)


def config_from_args(a: argparse.Namespace) -> GatewayConfig:
    if not a.engine and not a.engine_dns:
        raise ConfigError("the gateway needs rollout engines: --engine host:port (repeatable) or --engine-dns")
    fp = a.tokenizer_fingerprint
    if fp is not None and (len(fp) != 64 or any(c not in "0123456789abcdef" for c in fp)):
        raise ConfigError("--tokenizer-fingerprint must be a sha256 in hex (64 characters)")
    if a.virtual_nodes < 1 or not 0 <= a.virtual_node_reserve < 1 or a.load_bound < 1:
        raise ConfigError("--virtual-nodes >= 1, 0 <= --virtual-node-reserve < 1, --load-bound >= 1")
    return GatewayConfig(engines=tuple(a.engine), engine_dns=a.engine_dns, tokenizer_fingerprint=fp,
                         vnodes=a.virtual_nodes,
                         virtual_node_reserve=a.virtual_node_reserve, load_bound=a.load_bound,
                         heartbeat_s=a.heartbeat_interval, tls=tls_from_args(a),
                         connections=connection_limits_from_args(a),
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
