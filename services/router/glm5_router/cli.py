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

from glm5_router.config import ROUTING, BreakerConfig, RouterConfig
from glm5_router.server.app import serve_until_signal


def _weights(text: str) -> tuple[float, float, float]:
    try:
        a, b, c = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"three comma-separated numbers, not {text!r}") from None
    return a, b, c


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, b = RouterConfig(workers=("x:1",)), BreakerConfig()
    p.add_argument("--worker", action="append", default=[], help="worker host:port (repeatable)")
    p.add_argument("--worker-dns", help="host:port of a headless Service; every A record is a worker")
    p.add_argument("--host", default=d.host, help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--grpc-port", type=int, default=d.grpc_port, help="port of the gRPC API (glm5.v1.Router)")
    p.add_argument("--http-port", type=int, default=d.http_port, help="port of the OpenAI-compatible HTTP API")
    p.add_argument("--health-port", type=int, help="also answer gRPC health checks in plain text on this port "
                   "(Kubernetes' probes cannot speak TLS)")  # fmt: skip
    p.add_argument("--redis-url-file", help="read the Redis URL from this file (a mounted Secret key)")
    p.add_argument("--served-model-name", help="model name for clients (default: what the workers report)")
    p.add_argument("--default-max-new-tokens", type=int, default=d.default_max_new_tokens,
                   help="max new tokens of a request that sets none")  # fmt: skip
    p.add_argument("--token-budget", type=int, default=d.token_budget, help="flush a batch at this many new tokens")
    p.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms, help="... or after this wait")
    p.add_argument("--no-idle-flush", action="store_true", help="hold requests for an idle worker too (a plain "
                   "time window; for comparison)")  # fmt: skip
    p.add_argument("--short-max-prompt-tokens", type=int, default=d.short_max_prompt_tokens,
                   help="prompts under this many tokens go to the short lane (served first, FIFO)")  # fmt: skip
    p.add_argument("--long-min-prompt-tokens", type=int, default=d.long_min_prompt_tokens,
                   help="prompts from this many tokens go to the long lane (by KV cost, served last)")  # fmt: skip
    p.add_argument("--long-pause-kv-usage", type=float, default=d.long_pause_kv_usage,
                   help="the long lane waits while every routable worker's KV usage is above this share")  # fmt: skip
    p.add_argument("--max-queued", type=int, default=d.max_queued, help="queued requests; more are refused")
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout_s, help="seconds a request may wait")
    p.add_argument("--no-worker-timeout", type=float, default=d.no_worker_timeout_s,
                   help="with no routable worker, seconds a request waits before it fails with 503")  # fmt: skip
    p.add_argument("--redis-url", help="redis:// URL of a shared queue (several router replicas)")
    p.add_argument("--redis-url-env", help="read the Redis URL from this environment variable")
    p.add_argument("--redis-claims-per-worker", type=int, default=d.redis_claims_per_worker,
                   help="requests this router takes from the shared queue per routable worker")  # fmt: skip
    p.add_argument("--routing", choices=ROUTING, default=d.routing,
                   help="kv: to the worker holding most of the prompt in its prefix cache, weighed with its load; "
                        "load: least outstanding tokens; session: a session id or the prompt's first 64 tokens "
                        "hashed onto a worker")  # fmt: skip
    p.add_argument("--cache-index-blocks", type=int, default=d.cache_index_blocks,
                   help="prefix-block hashes --routing kv remembers (least recently used forgotten first)")  # fmt: skip
    p.add_argument("--kv-weights", type=_weights, default=d.kv_weights, metavar="PREFIX,LOAD,FREE_KV",
                   help="--routing kv's score: weights of the prompt's cached share, low outstanding tokens and "
                        "free KV blocks")  # fmt: skip
    p.add_argument("--affinity-load-factor", type=float, default=d.affinity_load_factor,
                   help="a session keeps its worker unless that is above this times the mean load")  # fmt: skip
    p.add_argument("--max-retries", type=int, default=d.max_retries,
                   help="retries on another worker of a request that has not streamed a token")  # fmt: skip
    p.add_argument("--retry-backoff-ms", type=float, default=d.retry_backoff_ms,
                   help="first retry backoff; doubles, with full jitter")  # fmt: skip
    p.add_argument("--stats-interval", type=float, default=d.stats_interval_s,
                   help="seconds between polls of each worker's stats and health")  # fmt: skip
    p.add_argument("--discovery-interval", type=float, default=d.discovery_interval_s,
                   help="seconds between lookups of --worker-dns")  # fmt: skip
    p.add_argument("--breaker-error-rate", type=float, default=b.error_rate,
                   help="eject a worker when this share of its calls in the window failed")  # fmt: skip
    p.add_argument("--breaker-window-seconds", type=float, default=b.window_s,
                   help="sliding window of the error rate")  # fmt: skip
    p.add_argument("--breaker-min-calls", type=int, default=b.min_calls,
                   help="calls in the window before the error rate counts")  # fmt: skip
    p.add_argument("--breaker-kv-fragmentation", type=float, default=b.kv_fragmentation,
                   help="soft signal: a worker's KV fragmentation above this halves its weight")  # fmt: skip
    p.add_argument("--breaker-entropy-drift", type=float, default=b.entropy_drift,
                   help="soft signal: attention-entropy drift above this halves its weight")  # fmt: skip
    p.add_argument("--breaker-token-jitter-ms", type=float, default=b.token_jitter_ms,
                   help="soft signal: per-token latency jitter above this halves its weight")  # fmt: skip
    p.add_argument("--breaker-spec-window-tokens", type=int, default=b.spec_window_tokens,
                   help="soft signal of a worker that speculates: draft tokens per acceptance window")  # fmt: skip
    p.add_argument("--breaker-spec-acceptance-drop", type=float, default=b.spec_acceptance_drop,
                   help="soft signal: a window's acceptance below this times the worker's own baseline halves its "
                        "weight (0: off)")  # fmt: skip
    p.add_argument("--breaker-spec-acceptance-max", type=float, default=b.spec_acceptance_max,
                   help="soft signal: a window's acceptance above this (implausible) halves its weight")  # fmt: skip
    p.add_argument("--breaker-sustained-seconds", type=float, default=b.sustained_s,
                   help="a soft signal over its threshold this long may eject the worker")  # fmt: skip
    p.add_argument("--breaker-open-seconds", type=float, default=b.open_s,
                   help="first open period of an ejected worker (doubles per failed probe, to 300 s)")  # fmt: skip
    p.add_argument("--breaker-half-open-share", type=float, default=b.half_open_share,
                   help="share of traffic a half-open worker gets as probes")  # fmt: skip
    p.add_argument("--breaker-max-ejection-percent", type=float, default=b.max_ejection_percent,
                   help="at most this share of the workers ejected at once; never the last one")  # fmt: skip
    p.add_argument("--sm4-key-dir", help="directory of SM4 keys (one file per key id), e.g. a mounted Secret")
    p.add_argument("--require-sealed", action="store_true",
                   help="serve only SM4-sealed gRPC requests; the HTTP API refuses generation")  # fmt: skip
    p.add_argument("--replay-window", type=float, default=d.replay_window_s,
                   help="seconds a sealed request stays valid; within it each one is served once")  # fmt: skip
    p.add_argument("--replay-skew", type=float, default=None,
                   help="seconds a sealed request may be dated in the future (clock skew between client and router; "
                   "default 30, at most --replay-window)")  # fmt: skip
    add_tls_arguments(p)
    add_connection_arguments(p)
    p.add_argument("--tls-require-client-cert", action="store_true",
                   help="with --tls-ca: callers of the router's gRPC API need client certificates too (the "
                   "workers' mTLS always does); default: TLS plus API keys")  # fmt: skip
    add_internal_token_arguments(p)
    lim = p.add_argument_group("what one request may hold (docs/router.md, Limits)")
    lim.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, help="HTTP body size")
    lim.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                     help="characters of prompt or message text, checked before tokenising")  # fmt: skip
    lim.add_argument("--max-messages", type=int, default=d.max_messages, help="messages of a chat request")
    lim.add_argument("--max-tools", type=int, default=d.max_tools, help="tools of a chat request")
    lim.add_argument("--http-idle-timeout", type=float, default=d.http_idle_timeout_s,
                     help="seconds an HTTP connection may stay without a complete request header")  # fmt: skip
    lim.add_argument("--http-body-timeout", type=float, default=d.http_body_timeout_s,
                     help="seconds to send a request body")  # fmt: skip
    lim.add_argument("--http-max-connections", type=int, default=d.http_max_connections,
                     help="open HTTP connections; more are answered 503")  # fmt: skip
    g = p.add_argument_group("OpenAI API access (docs/security.md)")
    g.add_argument("--api-key", action="append", default=[],
                   help="a key clients must send as 'Authorization: Bearer' (repeatable, for rotation)")  # fmt: skip
    g.add_argument("--api-key-env", help="environment variable holding API keys (comma-separated)")
    g.add_argument("--api-key-file", help="file of API keys, one per line (a mounted Secret)")
    g.add_argument("--public-metrics", action="store_true",
                   help="with API keys: serve /metrics without a key too (it names the workers)")  # fmt: skip
    g.add_argument("--public-health-details", action="store_true",
                   help="with API keys: /health lists the workers to callers without a key too")  # fmt: skip
    g.add_argument("--http-tls-cert", help="PEM certificate: serve the HTTP API over HTTPS")
    g.add_argument("--http-tls-key", help="PEM private key of --http-tls-cert")
    p.add_argument("--thinking-policy", default=d.thinking_policy, choices=["off", "light", "deep", "auto"],
                   help="reasoning of requests that do not choose (auto: on when the last user message holds "
                   "code)")  # fmt: skip
    p.add_argument("--tool-call-grammar", action=argparse.BooleanOptionalAction, default=d.tool_call_grammar,
                   help="under tool_choice auto, hold every tool call the model opens to the offered tools' names "
                   "and schemas (a lazy grammar: the text before stays free)")  # fmt: skip
    p.add_argument("--light-thinking-budget", type=int, default=d.light_thinking_budget,
                   help="reasoning tokens before light thinking is made to answer")  # fmt: skip
    p.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="tokens per streamed message for requests without their own (0: every step)")  # fmt: skip
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests may take to finish on SIGTERM / Ctrl-C")  # fmt: skip


def config_from_args(a: argparse.Namespace) -> RouterConfig:
    redis_url = a.redis_url or (os.environ.get(a.redis_url_env) if a.redis_url_env else None)
    if a.redis_url_file:
        urls = read_secrets((), None, a.redis_url_file, "--redis-url-file")
        if not urls:
            raise ConfigError(f"--redis-url-file {a.redis_url_file} is empty")
        redis_url = urls[0].value
    breaker = BreakerConfig(
        error_rate=a.breaker_error_rate, window_s=a.breaker_window_seconds, min_calls=a.breaker_min_calls,
        kv_fragmentation=a.breaker_kv_fragmentation, entropy_drift=a.breaker_entropy_drift,
        token_jitter_ms=a.breaker_token_jitter_ms, sustained_s=a.breaker_sustained_seconds,
        spec_window_tokens=a.breaker_spec_window_tokens, spec_acceptance_drop=a.breaker_spec_acceptance_drop,
        spec_acceptance_max=a.breaker_spec_acceptance_max, open_s=a.breaker_open_seconds,
        max_open_s=max(300.0, a.breaker_open_seconds),
        half_open_share=a.breaker_half_open_share, max_ejection_percent=a.breaker_max_ejection_percent,
    )  # fmt: skip
    return RouterConfig(
        workers=tuple(a.worker), worker_dns=a.worker_dns, host=a.host, grpc_port=a.grpc_port,
        http_port=a.http_port, health_port=a.health_port, served_model_name=a.served_model_name,
        default_max_new_tokens=a.default_max_new_tokens, token_budget=a.token_budget, max_wait_ms=a.max_wait_ms,
        flush_when_idle=not a.no_idle_flush,
        short_max_prompt_tokens=a.short_max_prompt_tokens, long_min_prompt_tokens=a.long_min_prompt_tokens,
        long_pause_kv_usage=a.long_pause_kv_usage, max_queued=a.max_queued, queue_timeout_s=a.queue_timeout,
        no_worker_timeout_s=a.no_worker_timeout,
        redis_url=redis_url, redis_claims_per_worker=a.redis_claims_per_worker,
        routing=a.routing, cache_index_blocks=a.cache_index_blocks, kv_weights=a.kv_weights,
        affinity_load_factor=a.affinity_load_factor, max_retries=a.max_retries,
        retry_backoff_ms=a.retry_backoff_ms, stats_interval_s=a.stats_interval,
        discovery_interval_s=a.discovery_interval, breaker=breaker, sm4_key_dir=a.sm4_key_dir,
        thinking_policy=a.thinking_policy, light_thinking_budget=a.light_thinking_budget,
        stream_interval=a.stream_interval, tool_call_grammar=a.tool_call_grammar,
        tls=dataclasses.replace(tls_from_args(a), require_client_cert=a.tls_require_client_cert),
        internal_token=internal_token_from_args(a),
        http_tls=TlsConfig(a.http_tls_cert, a.http_tls_key),
        api_keys=read_secrets(a.api_key, a.api_key_env, a.api_key_file, "API keys"),
        require_sealed=a.require_sealed, replay_window_s=a.replay_window,
        replay_skew_s=a.replay_skew, max_request_bytes=a.max_request_bytes,
        max_prompt_chars=a.max_prompt_chars, max_messages=a.max_messages, max_tools=a.max_tools,
        http_idle_timeout_s=a.http_idle_timeout, http_body_timeout_s=a.http_body_timeout,
        http_max_connections=a.http_max_connections, grpc_connections=connection_limits_from_args(a),
        public_metrics=a.public_metrics,
        public_health_details=a.public_health_details,
    )  # fmt: skip


def run(a: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_until_signal(config_from_args(a), a.shutdown_grace))
