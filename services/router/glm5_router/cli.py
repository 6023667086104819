"""`glm5 router`: flags -> RouterConfig -> gRPC + HTTP servers. The flag names match the operator's
router.json (see docs/operator.md), which the router reads with --config."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os

from glm5.errors import ConfigError
from glm5.security import (
    TlsConfig,
    add_internal_token_arguments,
    add_tls_arguments,
    internal_token_from_args,
    read_secrets,
    tls_from_args,
)
from glm5.serving import add_connection_arguments, connection_limits_from_args
from glm5.settings import add_flags, from_flags, group

from glm5_router.config import ACCESS, BreakerConfig, RouterConfig
from glm5_router.server.app import serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, RouterConfig)  # the router's settings; what follows builds the derived ones
    add_flags(p, BreakerConfig, prefix="breaker-")
    p.add_argument("--redis-url", help="redis:// URL of a shared queue (several router replicas)")
    p.add_argument("--redis-url-env", help="read the Redis URL from this environment variable")
    p.add_argument("--redis-url-file", help="read the Redis URL from this file (a mounted Secret key)")
    add_tls_arguments(p)
    add_connection_arguments(p)
    p.add_argument("--tls-require-client-cert", action="store_true",
                   help="with --tls-ca: callers of the router's gRPC API need client certificates too (the "
                   "workers' mTLS always does); default: TLS plus API keys")  # fmt: skip
    add_internal_token_arguments(p)
    g = group(p, ACCESS)
    g.add_argument("--api-key", action="append", default=[],
                   help="a key clients must send as 'Authorization: Bearer' (repeatable, for rotation)")  # fmt: skip
    g.add_argument("--api-key-env", help="environment variable holding API keys (comma-separated)")
    g.add_argument("--api-key-file", help="file of API keys, one per line (a mounted Secret)")
    g.add_argument("--http-tls-cert", help="PEM certificate: serve the HTTP API over HTTPS")
    g.add_argument("--http-tls-key", help="PEM private key of --http-tls-cert")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests may take to finish on SIGTERM / Ctrl-C")  # fmt: skip


def _redis_url(a: argparse.Namespace) -> str | None:
    if a.redis_url_file:
        urls = read_secrets((), None, a.redis_url_file, "--redis-url-file")
        if not urls:
            raise ConfigError(f"--redis-url-file {a.redis_url_file} is empty")
        return urls[0].value
    return a.redis_url or (os.environ.get(a.redis_url_env) if a.redis_url_env else None)


def config_from_args(a: argparse.Namespace) -> RouterConfig:
    breaker = from_flags(BreakerConfig, a, prefix="breaker-",
                         max_open_s=max(a.breaker_max_open_seconds, a.breaker_open_seconds))  # fmt: skip
    return from_flags(
        RouterConfig, a, redis_url=_redis_url(a), breaker=breaker,
        tls=dataclasses.replace(tls_from_args(a), require_client_cert=a.tls_require_client_cert),
        internal_token=internal_token_from_args(a), http_tls=TlsConfig(a.http_tls_cert, a.http_tls_key),
        api_keys=read_secrets(a.api_key, a.api_key_env, a.api_key_file, "API keys"),
        grpc_connections=connection_limits_from_args(a),
    )  # fmt: skip


def run(a: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_until_signal(config_from_args(a), a.shutdown_grace))
