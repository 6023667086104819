"""A worker stays observable while it prefills a 16K-token prompt: engine steps run off the event loop, health
checks answer at once and GetStats within its short wait (with the last stats when a step is still running),
so neither a Kubernetes probe nor a router's poll mistakes a busy worker for a dead one."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import grpc
from glm5.client import sampling
from glm5.v1 import worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.procs import start_worker, stop

PROMPT_TOKENS = 22_000  # ~10 s of prefill here (16K took 4.8-6 s): long enough to be watched by dozens of polls


def test_health_and_stats_answer_during_a_long_prefill(tiny_model: Path, tmp_path: Path) -> None:
    proc, target = start_worker(tiny_model, "--max-model-len", str(PROMPT_TOKENS + 64), "--kv-cache-bytes", "256MiB",
                                log=tmp_path / "worker.log")  # fmt: skip

    async def go() -> tuple[float, float, float, int]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub, health = worker_pb2_grpc.WorkerStub(ch), health_pb2_grpc.HealthStub(ch)
            ids = [(i * 7) % 1000 + 10 for i in range(PROMPT_TOKENS)]
            request = worker_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling(max_new_tokens=1))

            async def generate() -> float:
                start = time.perf_counter()
                async for _ in stub.Generate(request, timeout=600):
                    pass
                return time.perf_counter() - start

            task = asyncio.create_task(generate())
            worst_health = worst_stats = 0.0
            polls = 0
            while not task.done():
                start = time.perf_counter()
                assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == 1
                worst_health = max(worst_health, time.perf_counter() - start)
                start = time.perf_counter()
                await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)
                worst_stats = max(worst_stats, time.perf_counter() - start)
                polls += 1
                await asyncio.sleep(0.2)
            return await task, worst_health, worst_stats, polls

    # this process's own full collections (pytest's heap: 100-250 ms on busy cores) would be timed as the worker's
    gc.disable()
    try:
        prefill_s, worst_health, worst_stats, polls = asyncio.run(go())
    finally:
        gc.enable()
        stop(proc)
    assert prefill_s > 5 and polls > 10, (
        f"the prefill took {prefill_s:.1f} s, {polls} polls: too short to show anything"
    )
    assert worst_health < 0.1, f"a health check took {worst_health * 1000:.0f} ms during the prefill"
    assert worst_stats < 0.5, f"GetStats took {worst_stats * 1000:.0f} ms during the prefill"
