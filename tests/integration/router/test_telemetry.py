"""Traces (OpenTelemetry, in-memory exporter) and Prometheus metrics of a router running in this process
against a scripted worker process."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from glm5_router.config import RouterConfig
from glm5_router.server.app import RouterApp, start_router
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.procs import free_port, start_scripted_worker, stop

pytestmark = pytest.mark.asyncio
EXPORTER = InMemorySpanExporter()


def _install_provider() -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)  # once per process; the router's tracer resolves through it


_install_provider()


STATS = {
    "kv_usage": 0.25, "kv_fragmentation": 0.5, "kv_blocks_total": 64, "kv_blocks_free": 48,
    "attention_entropy_drift": 0.125, "token_latency_jitter_ms": 40.0, "mean_token_latency_ms": 12.0,
    "num_waiting": 3, "weight_version": 7, "prefix_cache_hit_rate": 0.75, "preemptions_total": 5,
    "layers": [{"layer": 0, "attention_entropy": 2.5, "topk": 256},
               {"layer": 2, "attention_entropy": 1.5, "topk": 384}],
    "speculative": {"method": "mtp", "num_speculative_tokens": 2, "drafts_total": 10, "draft_tokens_total": 20,
                    "accepted_tokens_total": 13, "accepted_tokens_by_position": [9, 4]},
}  # fmt: skip


async def _metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The router's /metrics as {(sample name, sorted labels): value}; fetched off the event loop the router
    serves from."""

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    text = await asyncio.to_thread(scrape)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


@pytest_asyncio.fixture
async def router(tmp_path: Path) -> AsyncIterator[tuple[RouterApp, str]]:
    (tmp_path / "stats.json").write_text(json.dumps(STATS))
    proc, worker = start_scripted_worker(tmp_path / "stats.json")
    app = await start_router(RouterConfig(workers=(worker,), host="127.0.0.1", grpc_port=free_port(),
                                          http_port=free_port(), stats_interval_s=0.2))  # fmt: skip
    try:
        yield app, worker
    finally:
        await app.stop(1.0)
        stop(proc)


async def test_spans_and_metrics(router: tuple[RouterApp, str]) -> None:
    app, worker = router
    EXPORTER.clear()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{app.http_port}/v1", api_key="none", max_retries=0)
    reply = await client.chat.completions.create(model="glm5-scripted", messages=[{"role": "user", "content": "THINK"}],
                                                 temperature=0.5)  # fmt: skip
    assert reply.choices[0].message.content == "The answer is 5."
    spans = {s.name: s for s in EXPORTER.get_finished_spans()}
    server, client_span = spans["chat glm5-scripted"], spans["glm5.v1.Worker/Generate"]
    attrs: dict[str, Any] = dict(server.attributes or {})
    assert server.kind == trace.SpanKind.SERVER and client_span.kind == trace.SpanKind.CLIENT
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "glm5-scripted"
    assert attrs["gen_ai.request.temperature"] == 0.5 and attrs["gen_ai.response.finish_reasons"] == ("stop",)
    assert attrs["gen_ai.usage.output_tokens"] > 0 and attrs["glm5.worker"] == worker
    assert client_span.parent is not None and client_span.parent.span_id == server.context.span_id
    assert dict(client_span.attributes or {})["server.address"] == worker

    key = ("glm5_worker_generated_tokens_total", (("worker", worker),))
    for _ in range(100):  # until a stats poll after the request has landed
        samples = await _metrics(app.http_port)
        if samples.get(key, 0) > 0:
            break
        await asyncio.sleep(0.05)
    assert samples[("glm5_router_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("glm5_router_queue_wait_seconds_count", ())] >= 1
    assert samples[("glm5_router_tokens_total", (("type", "completion"),))] > 0
    assert samples[("glm5_router_requests_total", (("outcome", "ok"),))] >= 1
    assert samples[("glm5_router_breaker_state", (("worker", worker),))] == 0
    assert ("glm5_router_queue_depth", (("lane", "short"),)) in samples
    # the worker's signals as the router last polled them, in base units
    w = (("worker", worker),)
    assert samples[("glm5_worker_up", w)] == 1
    assert samples[("glm5_worker_kv_usage_ratio", w)] == 0.25
    assert samples[("glm5_worker_kv_fragmentation_ratio", w)] == 0.5
    assert samples[("glm5_worker_kv_blocks", w)] == 64 and samples[("glm5_worker_kv_blocks_free", w)] == 48
    assert samples[("glm5_worker_attention_entropy_drift", w)] == 0.125
    assert samples[("glm5_worker_token_latency_jitter_seconds", w)] == pytest.approx(0.040)
    assert samples[("glm5_worker_token_latency_mean_seconds", w)] == pytest.approx(0.012)
    assert samples[("glm5_worker_requests_waiting", w)] == 3
    assert samples[("glm5_worker_weight_version", w)] == 7
    assert samples[("glm5_worker_prefix_cache_hit_ratio", w)] == 0.75
    assert samples[("glm5_worker_preemptions_total", w)] == 5
    assert samples[key] > 0
    assert samples[("glm5_worker_layer_attention_entropy", (("layer", "2"), ("worker", worker)))] == 1.5
    assert samples[("glm5_worker_layer_topk", (("layer", "2"), ("worker", worker)))] == 384
    spec = (("method", "mtp"), ("worker", worker))
    assert samples[("glm5_worker_spec_decode_drafts_total", spec)] == 10
    assert samples[("glm5_worker_spec_decode_draft_tokens_total", spec)] == 20
    assert samples[("glm5_worker_spec_decode_accepted_tokens_total", spec)] == 13
    per_position = "glm5_worker_spec_decode_accepted_tokens_per_position_total"
    at = [samples[(per_position, (("method", "mtp"), ("position", str(i)), ("worker", worker)))] for i in (0, 1)]
    assert at == [9, 4]


async def test_a_worker_that_stops_answering_is_reported_down(router: tuple[RouterApp, str], tmp_path: Path) -> None:
    app, worker = router
    (tmp_path / "stats.json").write_text(json.dumps({**STATS, "_unhealthy": True}))

    w = (("worker", worker),)
    for _ in range(100):
        samples = await _metrics(app.http_port)
        if samples[("glm5_worker_up", w)] == 0:
            break
        await asyncio.sleep(0.05)
    assert samples[("glm5_worker_up", w)] == 0
    # its last polled signals stay visible, marked by glm5_worker_up
    assert samples[("glm5_worker_kv_usage_ratio", w)] == 0.25
