"""Metrics (Prometheus, /metrics on the HTTP port) and traces (OpenTelemetry).

Metrics: time to first token, time per output token, token usage, queue wait, queue depth, requests by
outcome, retries, breaker state and transitions, and each worker's signals as last polled (KV usage and
fragmentation, attention-entropy drift, token-latency jitter, running/waiting, per-layer entropy and top-k,
speculative decoding's drafted and accepted tokens: `glm5_worker_*{worker=...}`), so one scrape of the router
shows what its breaker sees.

Traces: a server span per request (gen_ai.* attributes) and a client span per worker attempt. Traces are
exported only when configured the standard way: OTEL_TRACES_EXPORTER=console|otlp (otlp needs
opentelemetry-exporter-otlp; endpoint and headers from OTEL_EXPORTER_OTLP_*); otherwise the tracer is
OpenTelemetry's no-op and costs nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from glm5.errors import ConfigError
from glm5.v1 import worker_pb2
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}


# Worker signals as last polled (Worker.GetStats, every stats_interval_s): (metric, help, field, scale to base unit)
WORKER_GAUGES = (
    ("glm5_worker_kv_usage_ratio", "Share of the worker's KV blocks in use", "kv_usage", 1.0),
    ("glm5_worker_kv_fragmentation_ratio", "Share of free KV blocks outside the largest free run",
     "kv_fragmentation", 1.0),
    ("glm5_worker_kv_blocks", "KV blocks in the worker's pool", "kv_blocks_total", 1.0),
    ("glm5_worker_kv_blocks_free", "Free KV blocks", "kv_blocks_free", 1.0),
    ("glm5_worker_attention_entropy_drift", "Largest attention-entropy drift over layers",
     "attention_entropy_drift", 1.0),
    ("glm5_worker_token_latency_jitter_seconds", "Standard deviation of inter-token latency (recent window)",
     "token_latency_jitter_ms", 1e-3),
    ("glm5_worker_token_latency_mean_seconds", "Mean inter-token latency (recent window)", "mean_token_latency_ms",
     1e-3),
    ("glm5_worker_requests_running", "Requests in the worker's running batch", "num_running", 1.0),
    ("glm5_worker_requests_waiting", "Requests waiting in the worker", "num_waiting", 1.0),
    ("glm5_worker_weight_version", "Weight version the worker serves", "weight_version", 1.0),
    ("glm5_worker_prefix_cache_hit_ratio", "Share of prompt tokens served from the prefix cache",
     "prefix_cache_hit_rate", 1.0),
)  # fmt: skip

if TYPE_CHECKING:
    from glm5_router.workers.cache_index import CacheIndex
    from glm5_router.workers.picker import RoutedTokens


class WorkerSnapshot(NamedTuple):
    breaker: str  # its state's value
    healthy: bool
    stats: worker_pb2.WorkerStats | None  # as last polled
    outstanding_tokens: int  # this router's requests to it: their max_new_tokens, summed
    in_flight: int  # ... and their number


class _LiveState(Collector):
    """Queue depth, breaker states and the workers' polled signals, read at scrape time (no bookkeeping on the
    hot path)."""

    def __init__(
        self,
        depth: Callable[[], dict[str, int]],
        workers: Callable[[], dict[str, WorkerSnapshot]],
    ) -> None:
        self.depth = depth
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        q = GaugeMetricFamily("glm5_router_queue_depth", "Requests waiting in this router's queues", labels=["lane"])
        for lane, n in self.depth().items():
            q.add_metric([lane], n)
        yield q
        workers = self.workers()
        b = GaugeMetricFamily("glm5_router_breaker_state", "Circuit breaker per worker: 0 closed, 1 half-open, 2 open",
                              labels=["worker"])  # fmt: skip
        for worker, snap in workers.items():
            b.add_metric([worker], BREAKER_VALUES[snap.breaker])
        yield b
        yield from self._worker_signals(workers)

    @staticmethod
    def _worker_signals(workers: dict[str, WorkerSnapshot]) -> Iterator[Metric]:
        up = GaugeMetricFamily("glm5_worker_up", "1 if the worker answered its last health poll", labels=["worker"])
        for address, snap in workers.items():
            up.add_metric([address], 1.0 if snap.healthy else 0.0)
        yield up
        # this router's own share of each worker's load: summed over router replicas it is the whole load (an
        # autoscaling signal); the polled gauges below are the same on every replica
        inflight = GaugeMetricFamily("glm5_router_inflight_tokens", "Tokens this router's requests to the worker may "
                                     "still generate (their max_new_tokens)", labels=["worker"])  # fmt: skip
        requests = GaugeMetricFamily("glm5_router_inflight_requests", "This router's requests the worker has not "
                                     "finished", labels=["worker"])  # fmt: skip
        draining = GaugeMetricFamily("glm5_worker_draining", "1 while the worker shuts down (takes no new requests)",
                                     labels=["worker"])  # fmt: skip
        for address, snap in workers.items():
            inflight.add_metric([address], float(snap.outstanding_tokens))
            requests.add_metric([address], float(snap.in_flight))
            if snap.stats is not None:
                draining.add_metric([address], 1.0 if snap.stats.draining else 0.0)
        yield inflight
        yield requests
        yield draining
        polled = {address: snap.stats for address, snap in workers.items() if snap.stats is not None}
        for name, doc, field, scale in WORKER_GAUGES:
            g = GaugeMetricFamily(name, f"{doc}, as last polled", labels=["worker"])
            for address, stats in polled.items():
                g.add_metric([address], float(getattr(stats, field)) * scale)
            yield g
        tokens = CounterMetricFamily("glm5_worker_generated_tokens", "Tokens the worker process has generated",
                                     labels=["worker"])  # fmt: skip
        preemptions = CounterMetricFamily("glm5_worker_preemptions", "Sequences the worker preempted (KV pool full)",
                                          labels=["worker"])  # fmt: skip
        entropy = GaugeMetricFamily("glm5_worker_layer_attention_entropy", "Smoothed sparse-attention entropy (nats)",
                                    labels=["worker", "layer"])  # fmt: skip
        topk = GaugeMetricFamily("glm5_worker_layer_topk", "Top-k in use (the dynamic-sparsity controller widens it)",
                                 labels=["worker", "layer"])  # fmt: skip
        for address, stats in polled.items():
            tokens.add_metric([address], float(stats.generated_tokens_total))
            preemptions.add_metric([address], float(stats.preemptions_total))
            for layer in stats.layers:
                entropy.add_metric([address, str(layer.layer)], layer.attention_entropy)
                topk.add_metric([address, str(layer.layer)], layer.topk)
        yield tokens
        yield preemptions
        yield entropy
        yield topk
        yield from _speculative(polled)


# Speculative decoding per worker (WorkerStats.speculative), vLLM's spec_decode counters: the acceptance rate is
# rate(accepted_tokens) / rate(draft_tokens), the mean accepted length 1 + rate(accepted_tokens) / rate(drafts).
SPEC_COUNTERS = (
    ("glm5_worker_spec_decode_drafts", "Sequence-steps that verified draft tokens", "drafts_total"),
    ("glm5_worker_spec_decode_draft_tokens", "Draft tokens proposed", "draft_tokens_total"),
    ("glm5_worker_spec_decode_accepted_tokens", "Draft tokens accepted", "accepted_tokens_total"),
)


def _speculative(polled: dict[str, worker_pb2.WorkerStats]) -> Iterator[Metric]:
    drafting = {address: stats.speculative for address, stats in polled.items() if stats.HasField("speculative")}
    for name, doc, field in SPEC_COUNTERS:
        c = CounterMetricFamily(name, doc, labels=["worker", "method"])
        for address, spec in drafting.items():
            c.add_metric([address, spec.method], float(getattr(spec, field)))
        yield c
    by_position = CounterMetricFamily("glm5_worker_spec_decode_accepted_tokens_per_position",
                                      "Draft tokens accepted, by draft position (0: the first)",
                                      labels=["worker", "method", "position"])  # fmt: skip
    for address, spec in drafting.items():
        for position, n in enumerate(spec.accepted_tokens_by_position):
            by_position.add_metric([address, spec.method, str(position)], float(n))
    yield by_position


class _CacheRouting(Collector):
    """--routing kv: the cache index's size against its cap, what it forgot for room, resynchronisations per
    worker, and the prompt tokens routed against those the chosen worker was believed to hold."""

    def __init__(self, index: CacheIndex, routed: RoutedTokens) -> None:
        self.index = index
        self.routed = routed

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("glm5_router_cache_index_blocks", "Prefix-block hashes in the kv routing index",
                                value=len(self.index))  # fmt: skip
        yield GaugeMetricFamily("glm5_router_cache_index_capacity_blocks", "The index's cap (--cache-index-blocks)",
                                value=self.index.capacity)  # fmt: skip
        yield CounterMetricFamily("glm5_router_cache_index_evictions", "Hashes the index forgot for room",
                                  value=self.index.evictions)  # fmt: skip
        resyncs = CounterMetricFamily("glm5_router_cache_index_snapshots", "Snapshots of a worker's prefix cache "
                                      "applied (its first, then after a gap, restart or weight swap)",
                                      labels=["worker"])  # fmt: skip
        for address, n in self.index.resyncs.items():
            resyncs.add_metric([address], n)
        yield resyncs
        yield CounterMetricFamily("glm5_router_routed_prompt_tokens", "Prompt tokens routed by --routing kv",
                                  value=self.routed.prompt)  # fmt: skip
        yield CounterMetricFamily("glm5_router_routed_cached_tokens", "Of those, the tokens the chosen worker was "
                                  "believed to hold in its prefix cache", value=self.routed.cached)  # fmt: skip


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("glm5_router_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram("glm5_router_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.queue_wait = Histogram("glm5_router_queue_wait_seconds", "From arrival to being sent to a worker",
                                    buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.tokens = Counter("glm5_router_tokens", "Tokens by type", ["type"], registry=r)
        self.requests = Counter("glm5_router_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.retries = Counter("glm5_router_retries", "Requests retried on another worker", registry=r)
        self.tool_call_errors = Counter("glm5_router_tool_call_errors", "Tool calls refused (never passed on as "
                                        "calls or as content), by reason", ["reason"], registry=r)  # fmt: skip
        self.dispatch_failures = Counter("glm5_router_dispatch_failures", "Errors while dispatching (each failed "
                                         "one request, or one round of the dispatch loop)", registry=r)  # fmt: skip
        self.transitions = Counter("glm5_router_breaker_transitions", "Breaker state changes", ["worker", "to"],
                                   registry=r)  # fmt: skip
        self.tracer = trace.get_tracer("glm5.router")

    def watch(self, depth: Callable[[], dict[str, int]], workers: Callable[[], dict[str, WorkerSnapshot]]) -> None:
        self.registry.register(_LiveState(depth, workers))

    def watch_cache(self, index: CacheIndex, routed: RoutedTokens) -> None:
        self.registry.register(_CacheRouting(index, routed))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def configure_tracing(service_name: str = "glm5-router") -> None:
    """Install an exporting tracer provider when OTEL_TRACES_EXPORTER asks for one; otherwise do nothing."""
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if exporter_name in ("", "none"):
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    exporter: SpanExporter
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ConfigError("OTEL_TRACES_EXPORTER=otlp needs: pip install opentelemetry-exporter-otlp") from exc
        exporter = OTLPSpanExporter()
    else:
        raise ConfigError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: this router supports none, console and otlp")
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
