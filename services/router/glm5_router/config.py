"""RouterConfig: every router setting, validated once at start-up. Defaults are the source material's
(docs/router.md); the flag names are the contract with the operator's router.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from glm5.errors import ConfigError
from glm5.security import LOOPBACK, NO_TLS, Secret, TlsConfig
from glm5.serving import DEFAULT_CONNECTIONS, ConnectionLimits

ThinkingPolicy = Literal["off", "light", "deep", "auto"]


ROUTING = ("kv", "load", "session")


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    error_rate: float = 0.5  # open when this share of recent calls failed ...
    window_s: float = 30.0  # ... within this sliding window ...
    min_calls: int = 10  # ... and there were at least this many calls
    kv_fragmentation: float = 0.65
    entropy_drift: float = 0.12
    token_jitter_ms: float = 150.0
    sustained_s: float = 30.0  # a signal must stay over its threshold this long
    # speculative decoding's acceptance (workers that draft): a window of this many draft tokens whose acceptance
    # rate is below spec_acceptance_drop x the worker's own baseline, or above spec_acceptance_max, is a soft
    # signal (Z.ai flagged garbled output by acceptance rate > 0.96 and accepted length < 1.4)
    spec_window_tokens: int = 256
    spec_acceptance_drop: float = 0.5
    spec_acceptance_max: float = 0.96
    open_s: float = 10.0  # first open period; doubles on every failed probe ...
    max_open_s: float = 300.0  # ... up to this
    half_open_share: float = 0.05  # share of traffic admitted as probes
    half_open_successes: int = 5  # probes that must succeed to close
    # at most this share of the pool ejected at once (Envoy's max_ejection_percent); never the last worker
    max_ejection_percent: float = 50.0

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


@dataclass(frozen=True, slots=True)
class RouterConfig:
    workers: tuple[str, ...] = ()  # static host:port list
    worker_dns: str | None = None  # host:port of a headless Service: one worker per A record
    host: str = LOOPBACK
    grpc_port: int = 50050
    http_port: int = 8000
    health_port: int | None = None  # plain-text gRPC health checks on their own port (probes, when TLS is on)
    served_model_name: str | None = None  # default: what the workers report
    default_max_new_tokens: int = 256
    # batching: flush a worker's batch at this many max_new_tokens, or after max_wait_ms, or when idle
    token_budget: int = 8192
    max_wait_ms: float = 5.0
    flush_when_idle: bool = True  # an idle worker gets a request at once (off: a plain time window)
    # queues
    short_max_prompt_tokens: int = 2048
    long_min_prompt_tokens: int = 32768
    long_pause_kv_usage: float = 0.85
    max_queued: int = 10000
    queue_timeout_s: float = 600.0  # default deadline for a queued request
    no_worker_timeout_s: float = 10.0  # with no routable worker, a request fails (503) after this wait
    redis_url: str | None = field(default=None, repr=False)  # may hold a password
    redis_claims_per_worker: int = 8  # requests a router takes from the shared queue per routable worker
    # routing
    # kv: by the prompt tokens a worker holds in its prefix cache (its cache events) and its load; load: least
    # outstanding tokens; session: rendezvous hashing of the session id or the prompt's first 64 tokens
    routing: str = "kv"
    cache_index_blocks: int = 262144  # block hashes the kv index keeps (LRU); ~64 MiB at the cap
    kv_weights: tuple[float, float, float] = (3.0, 1.0, 1.0)  # prefix hit share, low load, free KV (docs/router.md)
    affinity_load_factor: float = 1.25  # no worker above ceil(c * mean load) for affine requests
    max_retries: int = 2  # retries of a request that has not streamed a token yet
    retry_backoff_ms: float = 50.0  # first backoff; doubles, with full jitter
    stats_interval_s: float = 1.0  # worker stats/health poll
    discovery_interval_s: float = 5.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    # who may call and how (docs/security.md)
    tls: TlsConfig = NO_TLS  # gRPC server, and the router's client side to the workers
    internal_token: Secret | None = None  # sent to the workers with every call (their --internal-token-*)
    http_tls: TlsConfig = NO_TLS  # HTTPS for the OpenAI API
    api_keys: tuple[Secret, ...] = ()  # required as Bearer tokens on /v1/* and the gRPC API when set
    require_sealed: bool = False  # only SM4-sealed requests (gRPC); the HTTP API then refuses generation
    replay_window_s: float = 300.0  # a sealed request is accepted within this age, and only once
    replay_skew_s: float | None = None  # ... and at most this far in the future (None: 30 s, or the window if shorter)
    # what one request may hold (docs/router.md, "Limits"): each bounds its memory and event-loop time
    max_request_bytes: int = 8 << 20  # HTTP body
    max_prompt_chars: int = 2_000_000  # text of a prompt or of all messages, checked before tokenising
    max_messages: int = 2048
    max_tools: int = 256
    # what one connection may hold (docs/security.md, "Connections"): slow or idle clients cannot pin them
    http_idle_timeout_s: float = 30.0  # from connecting (or the last response) to a request's complete header
    http_body_timeout_s: float = 30.0  # to read a request's body
    http_max_connections: int = 4096  # open HTTP connections; more are answered 503 and closed
    grpc_connections: ConnectionLimits = DEFAULT_CONNECTIONS  # the gRPC API's listener
    public_metrics: bool = False  # with API keys: /metrics without a key too (it names the workers)
    public_health_details: bool = False  # with API keys: /health lists the workers to callers without a key
    # payloads and output
    sm4_key_dir: str | None = None
    thinking_policy: ThinkingPolicy = "auto"
    # tool_choice auto: every tool call the model opens is held to the offered tools' names and schemas by a
    # lazy grammar (text stays free); off: calls are only parsed and checked afterwards
    tool_call_grammar: bool = True
    light_thinking_budget: int = 256
    reasoning_cache_entries: int = 500  # per session; the oldest 20% go when full
    # tokens per streamed message for requests that do not set stream_interval (0: a message per engine step);
    # every message costs the router CPU whatever it carries, so this trades granularity for requests/s
    stream_interval: int = 0

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
