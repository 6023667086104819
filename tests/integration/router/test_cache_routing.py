"""KV-cache-aware routing against real workers (issue 37, items 1-2): the router's index follows a worker's own
cache events (stores, evictions, a weight swap that clears, a restart, a gap in the sequence numbers), and with
three workers behind a real router a prompt that shares a long prefix with an earlier one goes to the worker that
holds it, which reports the hit; the index stays under its cap."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from glm5.client import sampling
from glm5.kvcache.prefix import prompt_block_hashes
from glm5.security import admin_metadata
from glm5.v1 import worker_pb2, worker_pb2_grpc
from glm5_router.config import RouterConfig
from glm5_router.workers.pool import WorkerPool

from tests.helpers.procs import ADMIN_TOKEN, admin_flags, start_router, start_worker, stop

BS = 16
FLAGS = ("--block-size", str(BS), "--max-model-len", "512", "--enforce-eager", "--no-kv-int8-tier")


async def _generate(target: str, ids: list[int], new: int = 4) -> None:
    async with grpc.aio.insecure_channel(target) as ch:
        request = worker_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling(max_new_tokens=new,
                                                                                     ignore_eos=True))  # fmt: skip
        async for _ in worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=60):
            pass


async def _truth(target: str) -> set[bytes]:
    """What the worker's prefix cache holds: a snapshot, as a router that has nothing gets it."""
    async with grpc.aio.insecure_channel(target) as ch:
        stats = await worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.GetStatsRequest(cache_events=True))
    assert stats.cache_events.snapshot and stats.cache_events.block_size == BS
    return set(stats.cache_events.stored)


def _prompt(tag: int, n: int = 100) -> list[int]:
    return [(tag * 7919 + 31 * i) % 500 + 3 for i in range(n)]


def test_the_index_follows_a_workers_stores_evictions_swap_restart_and_gaps(tiny_model: Path, tmp_path: Path) -> None:
    flags = (*FLAGS, "--kv-cache-bytes", "1MiB", "--cache-event-log", "64", *admin_flags(tiny_model.parent))
    proc, target = start_worker(tiny_model, *flags)
    port = int(target.rsplit(":", 1)[1])

    async def go() -> None:
        # polled only when the test says so (the loop's interval is an hour)
        pool = WorkerPool(RouterConfig(workers=(target,), stats_interval_s=3600))
        await pool.start()
        index = pool.cache_index
        assert index is not None and index.resyncs == {target: 1} and not index.held_by(target)
        try:
            first = _prompt(1)
            await _generate(target, first)
            await pool._poll_all()
            held = index.held_by(target)
            assert set(prompt_block_hashes(first, BS)) <= held and held == await _truth(target)
            assert index.resyncs == {target: 1}  # a delta, not a snapshot
            blocks = pool.workers[target].stats.kv_blocks_total  # type: ignore[union-attr]
            for tag in range(2, 2 + blocks // 6 + 2):  # more than the pool holds: the first prompt's blocks go
                await _generate(target, _prompt(tag))
                await pool._poll_all()  # in step: deltas
            held = index.held_by(target)
            assert held == await _truth(target) and not set(prompt_block_hashes(first, BS)) & held
            assert index.resyncs == {target: 1}
            # a gap: more events than the worker keeps (64) between two polls
            for tag in range(100, 112):
                await _generate(target, _prompt(tag))
            await pool._poll_all()
            assert index.resyncs == {target: 2} and index.held_by(target) == await _truth(target)
            # a weight swap drops the cache: a new epoch, and the index holds nothing of this worker
            async with grpc.aio.insecure_channel(target) as ch:
                await worker_pb2_grpc.WorkerStub(ch).UpdateWeights(
                    worker_pb2.UpdateWeightsRequest(version=1, location=str(tiny_model)),
                    metadata=admin_metadata(ADMIN_TOKEN), timeout=120)  # fmt: skip
            await pool._poll_all()
            assert index.resyncs == {target: 3} and index.held_by(target) == set() == await _truth(target)
            await _generate(target, first)
            await pool._poll_all()
            assert set(prompt_block_hashes(first, BS)) <= index.held_by(target)
            # a restart on the same port: a new epoch again, so the old entries go
            nonlocal proc
            stop(proc)
            proc, _ = start_worker(tiny_model, *flags, port=port)
            for _ in range(50):
                await pool._poll_all()
                if index.resyncs[target] == 4:
                    break
                await asyncio.sleep(0.2)
            assert index.resyncs == {target: 4} and index.held_by(target) == set()
        finally:
            await pool.close()

    try:
        asyncio.run(go())
    finally:
        stop(proc)


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def _stats(target: str) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(target) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


@pytest.mark.parametrize("routing", ["kv", "load"])
def test_a_shared_prefix_goes_where_it_is_cached(tiny_model: Path, routing: str) -> None:
    """kv: the second prompt sharing 96 tokens with the first lands on the first's worker, which reports the hit;
    load (the control): it goes to another, idle worker, and no worker hits."""
    procs, targets = [], []
    try:
        for _ in range(3):
            proc, target = start_worker(tiny_model, *FLAGS, "--kv-cache-bytes", "8MiB")
            procs.append(proc)
            targets.append(target)
        router, _, base = start_router(targets, "--routing", routing, "--cache-index-blocks", "40")
        procs.append(router)
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
        shared = _prompt(5, 96)

        def complete(ids: list[int]) -> None:
            client.completions.create(model=client.models.list().data[0].id, prompt=ids, max_tokens=4, temperature=0)

        complete(shared + [7, 8, 9])
        (home,) = [t for t in targets if _stats(t).generated_tokens_total > 0]
        complete(shared + [11, 12, 13, 14])
        hit = {t: _stats(t).prefix_cache_hit_rate > 0 for t in targets}
        served = {t: _stats(t).generated_tokens_total for t in targets}
        if routing == "kv":
            assert hit == {t: t == home for t in targets} and served[home] == 8
            # a stream of unique prompts: the index stays under its cap, forgetting the least recently used
            for tag in range(20, 26):
                complete(_prompt(tag))
            assert _metric(base, "glm5_router_cache_index_blocks") <= 40
            assert _metric(base, "glm5_router_cache_index_evictions_total") > 0
            assert _metric(base, "glm5_router_routed_cached_tokens_total") >= 96
        else:
            assert not any(hit.values()) and served[home] == 4
    finally:
        for p in reversed(procs):
            stop(p)
