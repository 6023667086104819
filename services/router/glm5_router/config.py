"""RouterConfig: every router setting, validated once at start-up. Defaults are the source material's
(docs/router.md); the flag names are the contract with the operator's router.json."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from glm5.errors import ConfigError
from glm5.security import LOOPBACK, NO_TLS, Secret, TlsConfig
from glm5.serving import DEFAULT_CONNECTIONS, ConnectionLimits
from glm5.settings import derived, setting

ThinkingPolicy = Literal["off", "light", "deep", "auto"]


ROUTING = ("kv", "load", "session")


def _weights(text: str) -> tuple[float, float, float]:
    try:
        a, b, c = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"three comma-separated numbers, not {text!r}") from None
    return a, b, c


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """The circuit breaker's settings: the router's --breaker-* flags."""

    error_rate: float = setting(0.5, help="eject a worker when this share of its calls in the window failed")
    window_s: float = setting(30.0, name="window-seconds", help="sliding window of the error rate")
    min_calls: int = setting(10, help="calls in the window before the error rate counts")
    kv_fragmentation: float = setting(0.65, help="soft signal: a worker's KV fragmentation above this halves its "
                                      "weight")  # fmt: skip
    entropy_drift: float = setting(0.12, help="soft signal: attention-entropy drift above this halves its weight")
    token_jitter_ms: float = setting(150.0, help="soft signal: per-token latency jitter above this halves its "
                                     "weight")  # fmt: skip
    sustained_s: float = setting(30.0, name="sustained-seconds", help="a soft signal over its threshold this long "
                                 "may eject the worker")  # fmt: skip
    # speculative decoding's acceptance (workers that draft): Z.ai flagged garbled output by acceptance rate > 0.96
    # and accepted length < 1.4
    spec_window_tokens: int = setting(256, help="soft signal of a worker that speculates: draft tokens per "
                                      "acceptance window")  # fmt: skip
    spec_acceptance_drop: float = setting(0.5, help="soft signal: a window's acceptance below this times the "
                                          "worker's own baseline halves its weight (0: off)")  # fmt: skip
    spec_acceptance_max: float = setting(0.96, help="soft signal: a window's acceptance above this (implausible) "
                                         "halves its weight")  # fmt: skip
    open_s: float = setting(10.0, name="open-seconds", help="first open period of an ejected worker (doubles per "
                            "failed probe, to --breaker-max-open-seconds)")  # fmt: skip
    max_open_s: float = setting(300.0, name="max-open-seconds", help="longest open period (at least "
                                "--breaker-open-seconds)")  # fmt: skip
    half_open_share: float = setting(0.05, help="share of traffic a half-open worker gets as probes")
    half_open_successes: int = setting(5, help="probes that must succeed to close an ejected worker's breaker")
    # Envoy's max_ejection_percent
    max_ejection_percent: float = setting(50.0, help="at most this share of the workers ejected at once; never the "
                                          "last one")  # fmt: skip

    def __post_init__(self) -> None:
        if not 0 < self.error_rate <= 1 or not 0 < self.half_open_share <= 1:
            raise ConfigError("breaker error rate and half-open share must be in (0, 1]")
        if self.min_calls < 1 or self.half_open_successes < 1:
            raise ConfigError("breaker min calls and half-open successes must be >= 1")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ConfigError("--breaker-max-ejection-percent must be in [0, 100]")
        if self.spec_window_tokens < 1 or not 0 <= self.spec_acceptance_drop < 1 or self.spec_acceptance_max <= 0:
            raise ConfigError("--breaker-spec-window-tokens must be >= 1, --breaker-spec-acceptance-drop in [0, 1) "
                              "and --breaker-spec-acceptance-max > 0")  # fmt: skip
        if min(self.window_s, self.sustained_s, self.open_s) < 0 or self.max_open_s < self.open_s:
            raise ConfigError("breaker periods must be >= 0 and max open >= open")


LIMITS = "what one request may hold (docs/router.md, Limits)"
ACCESS = "OpenAI API access (docs/security.md)"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Every router setting; each field's flag (`glm5 router --help`) is declared with it (glm5.settings)."""

    workers: tuple[str, ...] = setting((), name="worker", repeat=True, help="worker host:port (repeatable)")
    worker_dns: str | None = setting(None, help="host:port of a headless Service; every A record is a worker")
    host: str = setting(LOOPBACK, help="address to listen on (0.0.0.0: every interface)")
    grpc_port: int = setting(50050, help="port of the gRPC API (glm5.v1.Router)")
    http_port: int = setting(8000, help="port of the OpenAI-compatible HTTP API")
    health_port: int | None = setting(None, help="also answer gRPC health checks in plain text on this port "
                                      "(Kubernetes' probes cannot speak TLS)")  # fmt: skip
    served_model_name: str | None = setting(None, help="model name for clients (default: what the workers report)")
    default_max_new_tokens: int = setting(256, help="max new tokens of a request that sets none")
    # batching: flush a worker's batch at this many max_new_tokens, or after max_wait_ms, or when idle
    token_budget: int = setting(8192, help="flush a batch at this many new tokens")
    max_wait_ms: float = setting(5.0, help="... or after this wait")
    flush_when_idle: bool = setting(True, name="idle-flush", help="an idle worker gets a request at once "
                                    "(--no-idle-flush: a plain time window, for comparison)")  # fmt: skip
    # queues
    short_max_prompt_tokens: int = setting(2048, help="prompts under this many tokens go to the short lane (served "
                                           "first, FIFO)")  # fmt: skip
    long_min_prompt_tokens: int = setting(32768, help="prompts from this many tokens go to the long lane (by KV "
                                          "cost, served last)")  # fmt: skip
    long_pause_kv_usage: float = setting(0.85, help="the long lane waits while every routable worker's KV usage is "
                                         "above this share")  # fmt: skip
    max_queued: int = setting(10000, help="queued requests; more are refused")
    queue_timeout_s: float = setting(600.0, name="queue-timeout", help="seconds a request may wait (its default "
                                     "deadline)")  # fmt: skip
    no_worker_timeout_s: float = setting(10.0, name="no-worker-timeout", help="with no routable worker, seconds a "
                                         "request waits before it fails with 503")  # fmt: skip
    redis_url: str | None = derived(None, repr=False, why="--redis-url, --redis-url-env or --redis-url-file "
                                    "(glm5_router.cli); it may hold a password")  # fmt: skip
    redis_claims_per_worker: int = setting(8, help="requests this router takes from the shared queue per routable "
                                           "worker")  # fmt: skip
    # routing
    routing: str = setting("kv", choices=ROUTING, help="kv: to the worker holding most of the prompt in its prefix "
                           "cache, weighed with its load; load: least outstanding tokens; session: a session id or "
                           "the prompt's first 64 tokens hashed onto a worker")  # fmt: skip
    cache_index_blocks: int = setting(262144, help="prefix-block hashes --routing kv remembers (least recently used "
                                      "forgotten first; ~64 MiB at the default)")  # fmt: skip
    kv_weights: tuple[float, float, float] = setting(
        (3.0, 1.0, 1.0), type=_weights, metavar="PREFIX,LOAD,FREE_KV", help="--routing kv's score: weights of the "
        "prompt's cached share, low outstanding tokens and free KV blocks (docs/router.md)")  # fmt: skip
    affinity_load_factor: float = setting(1.25, help="a session keeps its worker unless that is above this times "
                                          "the mean load")  # fmt: skip
    max_retries: int = setting(2, help="retries on another worker of a request that has not streamed a token")
    retry_backoff_ms: float = setting(50.0, help="first retry backoff; doubles, with full jitter")
    stats_interval_s: float = setting(1.0, name="stats-interval", help="seconds between polls of each worker's "
                                      "stats and health")  # fmt: skip
    discovery_interval_s: float = setting(5.0, name="discovery-interval", help="seconds between lookups of "
                                          "--worker-dns")  # fmt: skip
    breaker: BreakerConfig = derived(default_factory=BreakerConfig, why="the --breaker-* flags (BreakerConfig's)")
    # who may call and how (docs/security.md)
    tls: TlsConfig = derived(NO_TLS, why="--tls-* (glm5.security) and --tls-require-client-cert: the gRPC server, "
                             "and the router's client side to the workers")  # fmt: skip
    internal_token: Secret | None = derived(None, why="--internal-token-file / -env: sent to the workers with "
                                            "every call (their --internal-token-*)")  # fmt: skip
    http_tls: TlsConfig = derived(NO_TLS, why="--http-tls-cert and --http-tls-key: HTTPS for the OpenAI API")
    api_keys: tuple[Secret, ...] = derived((), why="--api-key, --api-key-env and --api-key-file: required as "
                                           "Bearer tokens on /v1/* and the gRPC API when set")  # fmt: skip
    require_sealed: bool = setting(False, help="serve only SM4-sealed gRPC requests; the HTTP API refuses "
                                   "generation")  # fmt: skip
    replay_window_s: float = setting(300.0, name="replay-window", help="seconds a sealed request stays valid; "
                                     "within it each one is served once")  # fmt: skip
    replay_skew_s: float | None = setting(None, name="replay-skew", help="seconds a sealed request may be dated in "
                                          "the future (clock skew between client and router; default 30, at most "
                                          "--replay-window)")  # fmt: skip
    # what one request may hold (docs/router.md, "Limits"): each bounds its memory and event-loop time
    max_request_bytes: int = setting(8 << 20, group=LIMITS, help="HTTP body size")
    max_prompt_chars: int = setting(2_000_000, group=LIMITS, help="characters of prompt or message text, checked "
                                    "before tokenising")  # fmt: skip
    max_messages: int = setting(2048, group=LIMITS, help="messages of a chat request")
    max_tools: int = setting(256, group=LIMITS, help="tools of a chat request")
    # what one connection may hold (docs/security.md, "Connections"): slow or idle clients cannot pin them
    http_idle_timeout_s: float = setting(30.0, name="http-idle-timeout", group=LIMITS, help="seconds an HTTP "
                                         "connection may stay without a complete request header")  # fmt: skip
    http_body_timeout_s: float = setting(30.0, name="http-body-timeout", group=LIMITS, help="seconds to send a "
                                         "request body")  # fmt: skip
    http_max_connections: int = setting(4096, group=LIMITS, help="open HTTP connections; more are answered 503")
    grpc_connections: ConnectionLimits = derived(DEFAULT_CONNECTIONS, why="the --grpc-* connection flags "
                                                 "(glm5.serving): the gRPC API's listener")  # fmt: skip
    public_metrics: bool = setting(False, group=ACCESS, help="with API keys: serve /metrics without a key too (it "
                                   "names the workers)")  # fmt: skip
    public_health_details: bool = setting(False, group=ACCESS, help="with API keys: /health lists the workers to "
                                          "callers without a key too")  # fmt: skip
    # payloads and output
    sm4_key_dir: str | None = setting(None, help="directory of SM4 keys (one file per key id), e.g. a mounted "
                                      "Secret")  # fmt: skip
    thinking_policy: ThinkingPolicy = setting("auto", help="reasoning of requests that do not choose (auto: on "
                                              "when the last user message holds code)")  # fmt: skip
    tool_call_grammar: bool = setting(True, help="under tool_choice auto, hold every tool call the model opens to "
                                      "the offered tools' names and schemas (a lazy grammar: the text before stays "
                                      "free); off: calls are only parsed and checked afterwards")  # fmt: skip
    light_thinking_budget: int = setting(256, help="reasoning tokens before light thinking is made to answer")
    reasoning_cache_entries: int = setting(500, help="earlier turns' reasoning kept per session; the oldest 20% go "
                                           "when full")  # fmt: skip
    # every message costs the router CPU whatever it carries, so this trades granularity for requests/s
    stream_interval: int = setting(0, help="tokens per streamed message for requests without their own (0: every "
                                   "step)")  # fmt: skip

    def __post_init__(self) -> None:
        if not self.workers and not self.worker_dns:
            raise ConfigError("the router needs workers: --worker host:port (repeatable) or --worker-dns host:port")
        for w in (*self.workers, *([self.worker_dns] if self.worker_dns else [])):
            host, _, port = w.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"worker address {w!r} must be host:port")
        if self.token_budget < 1 or self.max_wait_ms < 0:
            raise ConfigError("--token-budget must be >= 1 and --max-wait-ms >= 0")
        if not 1 <= self.short_max_prompt_tokens <= self.long_min_prompt_tokens:
            raise ConfigError("--short-max-prompt-tokens must be >= 1 and <= --long-min-prompt-tokens")
        if not 0 < self.long_pause_kv_usage <= 1:
            raise ConfigError("--long-pause-kv-usage must be in (0, 1]")
        if self.no_worker_timeout_s < 0:
            raise ConfigError("--no-worker-timeout must be >= 0")
        if self.redis_claims_per_worker < 1:
            raise ConfigError("--redis-claims-per-worker must be >= 1")
        if self.max_queued < 1 or self.queue_timeout_s <= 0 or self.default_max_new_tokens < 1:
            raise ConfigError("--max-queued, --queue-timeout and --default-max-new-tokens must be positive")
        if self.routing not in ROUTING:
            raise ConfigError(f"--routing must be one of {', '.join(ROUTING)}, not {self.routing!r}")
        if self.cache_index_blocks < 1:
            raise ConfigError("--cache-index-blocks must be >= 1")
        if len(self.kv_weights) != 3 or min(self.kv_weights) < 0 or not any(self.kv_weights):
            raise ConfigError("--kv-weights takes three weights >= 0, not all 0 (prefix hit, load, free KV)")
        if self.affinity_load_factor < 1 or self.max_retries < 0 or self.retry_backoff_ms < 0:
            raise ConfigError("--affinity-load-factor must be >= 1; retries and backoff >= 0")
        if self.thinking_policy not in ("off", "light", "deep", "auto"):
            raise ConfigError(f"--thinking-policy must be off, light, deep or auto, not {self.thinking_policy!r}")
        if self.reasoning_cache_entries < 1 or self.light_thinking_budget < 1:
            raise ConfigError("--reasoning-cache-entries and --light-thinking-budget must be >= 1")
        if self.require_sealed and not self.sm4_key_dir:
            raise ConfigError("--require-sealed needs SM4 keys (--sm4-key-dir)")
        if self.replay_window_s <= 0:
            raise ConfigError("--replay-window must be > 0 seconds")
        if self.replay_skew_s is not None and not 0 <= self.replay_skew_s <= self.replay_window_s:
            raise ConfigError("--replay-skew must be between 0 and --replay-window seconds")
        if min(self.max_request_bytes, self.max_prompt_chars, self.max_messages, self.max_tools) < 1:
            raise ConfigError("--max-request-bytes, --max-prompt-chars, --max-messages and --max-tools must be >= 1")
        if min(self.http_idle_timeout_s, self.http_body_timeout_s) <= 0 or self.http_max_connections < 1:
            raise ConfigError("--http-idle-timeout and --http-body-timeout must be > 0, --http-max-connections >= 1")
        if self.stream_interval < 0:
            raise ConfigError(f"--stream-interval must be >= 0, got {self.stream_interval}")
