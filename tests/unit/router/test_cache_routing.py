"""--routing kv (issue 37, item 2): the router's cache index (block hash -> workers, from the workers' cache
events and its own dispatches, LRU-capped) and the picker's score (the prompt's cached share, load, free KV)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, cast

import pytest
from glm5.errors import ConfigError
from glm5.kvcache.prefix import prompt_block_hashes
from glm5.v1 import worker_pb2
from glm5_router.config import BreakerConfig, RouterConfig
from glm5_router.scheduling.job import Job
from glm5_router.workers.breaker import CircuitBreaker
from glm5_router.workers.cache_index import CacheIndex
from glm5_router.workers.picker import Picker
from glm5_router.workers.pool import Worker

BS = 4


def _workers(n: int) -> list[Worker]:
    return [Worker(f"10.0.0.{i}:50051", cast(Any, None), cast(Any, None), CircuitBreaker(BreakerConfig()),
                   healthy=True, cache_block_size=BS) for i in range(n)]  # fmt: skip


def _job(ids: list[int], new: int = 16) -> Job:
    return Job("j", worker_pb2.GenerateRequest(prompt_token_ids=ids), len(ids), new, "short", time.monotonic() + 60)


def _events(epoch: int, after: int, seq: int, stored: list[bytes] = [], removed: list[bytes] = [],  # noqa: B006
            snapshot: bool = False) -> worker_pb2.CacheEvents:  # fmt: skip
    return worker_pb2.CacheEvents(epoch=epoch, after=after, seq=seq, stored=stored, removed=removed,
                                  snapshot=snapshot, block_size=BS)  # fmt: skip


def test_the_index_applies_deltas_in_order_snapshots_always_and_stays_under_its_cap() -> None:
    index = CacheIndex(capacity=6)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    assert index.cursor("w") == (0, 0)
    assert index.apply("w", _events(7, 0, 2, [a, b], snapshot=True))
    assert index.held_by("w") == {a, b} and index.cursor("w") == (7, 2) and index.resyncs == {"w": 1}
    assert not index.apply("w", _events(7, 5, 6, [c]))  # after another point (someone else's answer): ignored
    assert index.apply("w", _events(7, 2, 4, [c], [a]))
    assert index.held_by("w") == {b, c} and index.cursor("w") == (7, 4)
    assert index.apply("w", _events(9, 0, 1, [a], snapshot=True))  # a restart or swap: replaced
    assert index.held_by("w") == {a} and index.resyncs == {"w": 2}
    index.add("v", [a, b])
    assert index.matched([a, b, c], ["w", "v", "u"]) == {"w": 1, "v": 2, "u": 0}
    index.drop("v")
    assert index.matched([a, b], ["v"]) == {"v": 0} and len(index) == 1
    for i in range(20):  # a stream of unique prompts: the least recently used hashes go
        index.add("w", [bytes([i]) * 16])
    assert len(index) == 6 and index.evictions == 15 and len(index.held_by("w")) == 6


def test_kv_routing_follows_the_cached_prefix_within_the_load_bound() -> None:
    ws = _workers(3)
    index = CacheIndex(1000)
    picker = Picker(RouterConfig(workers=("x:1",)), index)
    system = list(range(100, 164))  # 16 blocks shared by every request
    first = picker.pick(ws, _job(system + [1, 2, 3]))
    assert first is not None and index.held_by(first.address)  # recorded at dispatch, before any event
    for w in ws:  # nothing in flight: the holder wins on the prefix
        assert picker.pick(ws, _job(system + [9, 9, w.address.count("1")])) is first
    assert picker.routed.cached >= 2 * len(system) - 2 * BS
    # the holder busier than the others: a 64-token cached prefix still outweighs the load term...
    for w in ws:
        w.in_flight = 1
    first.outstanding_tokens = 64
    assert picker.pick(ws, _job(system + [5])) is first
    # ...until the bound: no worker above ceil(1.25 * (in-flight + 1) / workers) + 1 = ceil(1.25 * 7 / 3) + 1 = 4
    first.in_flight = 4
    assert picker.pick(ws, _job(system + [6])) is not first
    # an unseen prompt goes to the least loaded; ties rotate over the idle ones
    for w in ws:
        w.outstanding_tokens = w.in_flight = 0
    spread = Counter(picker.pick(ws, _job([7000 + i] * 20)).address for i in range(6))  # type: ignore[union-attr]
    assert set(spread.values()) == {2}


def test_a_worker_with_a_longer_cached_prefix_wins_and_kv_usage_breaks_ties() -> None:
    ws = _workers(3)
    index = CacheIndex(1000)
    picker = Picker(RouterConfig(workers=("x:1",)), index)
    ids = list(range(40))
    hashes = prompt_block_hashes(ids, BS)
    index.add(ws[0].address, hashes[:3])
    index.add(ws[1].address, hashes[:8])
    assert picker.pick(ws, _job(ids)) is ws[1]
    fresh = list(range(500, 540))
    ws[0].stats = worker_pb2.WorkerStats(kv_usage=0.9)
    ws[2].stats = worker_pb2.WorkerStats(kv_usage=0.1)
    ws[1].stats = worker_pb2.WorkerStats(kv_usage=0.5)
    assert picker.pick(ws, _job(fresh)) is ws[2]


def test_routing_flags() -> None:
    assert RouterConfig(workers=("x:1",)).routing == "kv"
    for bad, match in (({"routing": "random"}, "--routing"), ({"cache_index_blocks": 0}, "--cache-index-blocks"),
                       ({"kv_weights": (0.0, 0.0, 0.0)}, "--kv-weights"), ({"kv_weights": (1.0, -1.0, 1.0)},
                                                                           "--kv-weights")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            RouterConfig(workers=("x:1",), **bad)  # type: ignore[arg-type]
