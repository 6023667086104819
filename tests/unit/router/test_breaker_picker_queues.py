"""Circuit breaker, worker picking and queues (pure logic, injected clock)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, cast

import pytest
from glm5.errors import CapacityError, ConfigError
from glm5.v1 import worker_pb2
from glm5_router.config import BreakerConfig, RouterConfig
from glm5_router.scheduling.dispatcher import FAILING_AFTER, Batch, Dispatcher
from glm5_router.scheduling.job import Job
from glm5_router.scheduling.queues import SHORT, InProcessQueues, lane_score
from glm5_router.workers.breaker import CircuitBreaker, State
from glm5_router.workers.picker import Picker
from glm5_router.workers.pool import Worker, WorkerPool


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _breaker(**kw: float) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(BreakerConfig(**kw), clock), clock  # type: ignore[arg-type]


def test_error_rate_opens_after_min_calls_and_window_forgets() -> None:
    b, clock = _breaker(min_calls=4, error_rate=0.5, window_s=10)
    for ok in (False, False, True):
        b.record(ok)
    assert b.state is State.CLOSED  # only 3 calls
    clock.t += 11  # the old calls leave the window
    for ok in (True, True, False):
        b.record(ok)
    assert b.state is State.CLOSED  # 1/3 in the window
    b.record(False)
    assert b.state is State.OPEN and "2/4" in b.reason and not b.allow()


def test_half_open_probes_close_or_reopen_with_backoff() -> None:
    b, clock = _breaker(min_calls=1, open_s=10, max_open_s=25, half_open_share=0.25, half_open_successes=2)
    b.record(False)
    assert b.current() is State.OPEN
    clock.t += 10
    assert b.current() is State.HALF_OPEN
    admitted = [b.allow() for _ in range(8)]
    assert admitted[0] and sum(admitted) == 2  # the first probe, then a 25% share
    b.record(False)  # a probe fails: open again, twice as long
    assert b.state is State.OPEN
    clock.t += 15
    assert b.current() is State.OPEN
    clock.t += 5
    assert b.current() is State.HALF_OPEN
    b.allow()
    b.record(True)
    b.allow()
    b.record(True)
    assert b.state is State.CLOSED


def test_signals_must_stay_over_threshold_for_the_sustained_time() -> None:
    b, clock = _breaker(sustained_s=30)
    bad = worker_pb2.WorkerStats(kv_fragmentation=0.7)
    b.observe(bad)
    clock.t += 20
    b.observe(worker_pb2.WorkerStats(kv_fragmentation=0.5))  # recovered: the timer restarts
    clock.t += 20
    b.observe(bad)
    assert b.state is State.CLOSED
    clock.t += 29
    b.observe(worker_pb2.WorkerStats(kv_fragmentation=0.7, token_latency_jitter_ms=10))
    assert b.state is State.CLOSED
    clock.t += 1
    b.observe(bad)
    assert b.state is State.OPEN and "kv_fragmentation" in b.reason
    b2, _ = _breaker(sustained_s=0)
    b2.observe(worker_pb2.WorkerStats(attention_entropy_drift=0.2))
    assert b2.state is State.OPEN
    b3, _ = _breaker(sustained_s=0)
    b3.observe(worker_pb2.WorkerStats(token_latency_jitter_ms=151))
    assert b3.state is State.OPEN


def _workers(n: int) -> list[Worker]:
    # Picking never touches the channel: none is opened.
    return [Worker(f"10.0.0.{i}:50051", cast(Any, None), cast(Any, None), CircuitBreaker(BreakerConfig()),
                   healthy=True) for i in range(n)]  # fmt: skip


def _picker(routing: str = "load") -> Picker:
    return Picker(RouterConfig(workers=("x:1",), routing=routing))


def _req(affinity: str | None = None, ids: list[int] | None = None) -> Job:
    request = worker_pb2.GenerateRequest(prompt_token_ids=ids or [])
    return Job("j", request, len(ids or []), 16, "short", time.monotonic() + 60, affinity)


def _spec(drafted: int, accepted: int) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(speculative=worker_pb2.SpeculativeStats(
        method="mtp", num_speculative_tokens=3, drafts_total=drafted // 3, draft_tokens_total=drafted,
        accepted_tokens_total=accepted))  # fmt: skip


def test_acceptance_below_the_workers_own_baseline_or_implausibly_high_is_a_soft_signal() -> None:
    b, clock = _breaker(sustained_s=30, spec_window_tokens=100)
    drafted = accepted = 0

    def window(rate: float, samples: int = 2) -> None:
        nonlocal drafted, accepted
        for _ in range(samples):  # a window fills over several polls
            drafted, accepted = drafted + 50, accepted + round(50 * rate)
            b.observe(_spec(drafted, accepted))
            clock.t += 5

    b.observe(_spec(0, 0))
    for rate in (0.3, 0.34, 0.26, 0.3, 0.32):  # a low rate, but the worker's own: healthy
        window(rate)
    assert b.degraded == {} and b.acceptance.baseline == pytest.approx(0.3, abs=0.02)
    window(0.1)  # a third of its baseline (the numerics went wrong)
    assert b.degraded == {"spec_acceptance": pytest.approx(0.1)} and b.weight == 0.5
    b.observe(_spec(drafted + 10, accepted))  # a window still filling: still degraded
    drafted += 10
    assert "spec_acceptance" in b.degraded and b.acceptance.baseline == pytest.approx(0.3, abs=0.02)
    for _ in range(3):
        window(0.1)
    assert b.state is State.OPEN and "spec_acceptance 0.1" in b.reason  # sustained for 30 s
    drafted = accepted = 0
    b.observe(_spec(0, 0))  # restarted while degraded: the verdict goes with the old counters
    assert "spec_acceptance" not in b.degraded and b.acceptance.baseline is None

    b, clock = _breaker(spec_window_tokens=100)
    b.observe(_spec(0, 0))
    drafted = accepted = 0
    window(0.98)  # near-total acceptance from the first window: the target repeats what the draft says
    assert b.degraded == {"spec_acceptance": pytest.approx(0.98)}
    window(0.6)
    assert b.degraded == {}
    for rate in (0.6, 0.6, 0.6):
        window(rate)
    # a worker restart resets its counters: no window spans it, and the baseline starts again
    drafted = accepted = 0
    b.observe(_spec(0, 0))
    assert b.acceptance.baseline is None and b.degraded == {}
    window(0.2)  # a new start's first windows only build its baseline
    assert b.degraded == {}
    b2, _ = _breaker(spec_window_tokens=100, spec_acceptance_drop=0.0, spec_acceptance_max=1.0)  # both off
    for i in range(20):
        b2.observe(_spec(100 * i, 90 * i if i < 10 else 900 + i))
    assert b2.degraded == {}
    b3, _ = _breaker()
    b3.observe(worker_pb2.WorkerStats())  # a worker that does not speculate: no signal
    assert b3.acceptance.rate is None and b3.degraded == {}
    with pytest.raises(ConfigError, match="spec-acceptance-drop"):
        BreakerConfig(spec_acceptance_drop=1.5)


def test_least_outstanding_with_round_robin_ties() -> None:
    ws = _workers(3)
    p = _picker()
    picked = Counter(p.pick(ws, _req()).address for _ in range(9))  # type: ignore[union-attr]
    assert set(picked.values()) == {3}  # idle pool: spread evenly
    ws[0].outstanding_tokens = 100
    ws[1].outstanding_tokens = 10
    assert {p.pick(ws, _req()).address for _ in range(5)} == {ws[2].address}  # type: ignore[union-attr]


def test_affinity_is_sticky_but_bounded() -> None:
    ws = _workers(4)
    p = _picker("session")
    home = p.pick(ws, _req("session-1"))
    assert home is not None and all(p.pick(ws, _req("session-1")) is home for _ in range(5))
    homes = {p.pick(ws, _req(f"s{i}")).address for i in range(40)}  # type: ignore[union-attr]
    assert len(homes) == 4  # keys spread over workers
    # A hot session: its home fills up to the bound, then the overflow goes elsewhere.
    for w in ws:
        w.in_flight = 0
    placed = []
    for _ in range(12):
        w = p.pick(ws, _req("hot"))
        assert w is not None
        w.in_flight += 1
        placed.append(w.address)
    assert max(Counter(placed).values()) <= 4  # ceil(1.25 * 12 / 4) = 4 at most on one worker


def test_open_breaker_is_skipped() -> None:
    ws = _workers(2)
    ws[0].breaker.state = State.OPEN
    ws[0].breaker._open_until = time.monotonic() + 60
    assert {_picker().pick(ws, _req()).address for _ in range(4)} == {ws[1].address}  # type: ignore[union-attr]
    ws[1].breaker.state = State.OPEN
    ws[1].breaker._open_until = time.monotonic() + 60
    assert _picker().pick(ws, _req()) is None


def _job(i: int, lane: str = "short", prompt: int = 10, new: int = 10) -> Job:
    return Job(f"j{i}", worker_pb2.GenerateRequest(), prompt, new, lane, time.monotonic() + 60)  # type: ignore[arg-type]


def test_queues_order_pause_and_capacity() -> None:
    q = InProcessQueues(max_queued=5)
    big, small = _job(1, "long", prompt=50000, new=100), _job(2, "long", prompt=33000, new=10)
    medium, short = _job(3, "medium"), _job(4, "short")
    for j in (big, small, medium, short):
        q.put(j)
    order = []
    while (j := q.peek(long_paused=False)) is not None:
        q.pop(j)
        order.append(j.id)
    assert order == ["j4", "j3", "j2", "j1"]  # short, medium, then long by KV cost
    q.put(big)
    assert q.peek(long_paused=True) is None and len(q) == 1  # paused under KV pressure, still queued
    retried = _job(5)
    q.put(_job(6))
    q.put(retried, front=True)
    assert q.peek(False) is retried
    for i in range(2):
        q.put(_job(10 + i))
    with pytest.raises(CapacityError, match="full"):
        q.put(_job(20))
    q.discard(retried)
    assert len(q) == 4 and q.peek(False).id == "j6"  # type: ignore[union-attr]
    assert q.depth() == {"short": 3, "medium": 0, "long": 1}  # a discarded job no longer counts


def test_a_retried_medium_job_goes_before_other_medium_jobs_not_before_short_ones() -> None:
    q = InProcessQueues(max_queued=10)
    first_medium, short, retried = _job(1, "medium"), _job(2, "short"), _job(3, "medium")
    for j in (first_medium, short):
        q.put(j)
    q.put(retried, front=True)
    order = []
    while (j := q.peek(long_paused=False)) is not None:
        q.pop(j)
        order.append(j.id)
    assert order == ["j2", "j3", "j1"]


def test_the_shared_queue_scores_jobs_as_the_in_process_queues_order_them() -> None:
    """The Redis queues (two sorted sets) and the in-process ones take their order from the same lane_score."""
    jobs = [_job(1, "long", prompt=900), _job(2, "medium"), _job(3, "short"), _job(4, "long", prompt=20)]
    by_score = sorted(jobs, key=lambda j: (lane_score(j, 1.7e9)[0] != SHORT, lane_score(j, 1.7e9)[1]))
    q = InProcessQueues(max_queued=10)
    for j in jobs:
        q.put(j)
    order = []
    while (j := q.peek(long_paused=False)) is not None:
        q.pop(j)
        order.append(j)
    assert [j.id for j in order] == [j.id for j in by_score] == ["j3", "j2", "j4", "j1"]


class RecordingDispatcher(Dispatcher):
    """Records batches instead of starting streams: the flush policy on its own."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config, WorkerPool(config), InProcessQueues(100))
        self.sent: list[list[str]] = []

    def _send(self, worker: Worker, batch: Batch) -> None:
        self.sent.append([j.id for j in batch.jobs])
        batch.jobs, batch.tokens = [], 0


def test_batches_flush_at_the_token_budget_after_the_wait_or_when_idle() -> None:
    async def go() -> list[list[str]]:
        d = RecordingDispatcher(RouterConfig(workers=("w:1",), token_budget=100, max_wait_ms=30))
        (w,) = _workers(1)
        d.pool.workers[w.address] = w
        d._assign(w, _job(1, new=40))  # idle worker: sent at once
        d._assign(w, _job(2, new=40))  # busy now: waits ...
        d._assign(w, _job(3, new=70))  # ... until the budget is reached
        d._assign(w, _job(4, new=10))
        d.start()
        await asyncio.sleep(0.1)  # ... or the wait passes
        await d.close()
        return d.sent

    assert asyncio.run(go()) == [["j1"], ["j2", "j3"], ["j4"]]


def test_router_config_names_the_bad_flag() -> None:
    with pytest.raises(ConfigError, match="--stream-interval"):
        RouterConfig(workers=("w:1",), stream_interval=-1)
    assert RouterConfig(workers=("w:1",), stream_interval=8).stream_interval == 8


def test_soft_signals_lower_the_weight_and_the_pool_keeps_its_last_worker() -> None:
    clock = Clock()
    spare = [False]
    b = CircuitBreaker(BreakerConfig(sustained_s=30), clock=clock, may_eject=lambda: spare[0])
    drifting = worker_pb2.WorkerStats(attention_entropy_drift=0.5)
    b.observe(drifting)
    assert b.state is State.CLOSED and b.weight == 0.5  # degraded at once, not ejected
    b.observe(worker_pb2.WorkerStats(attention_entropy_drift=0.5, kv_fragmentation=0.9))
    assert b.weight == 0.25
    clock.t += 31
    b.observe(drifting)  # sustained, but the pool cannot spare it
    assert b.state is State.CLOSED and b.ejections_withheld == 1 and "kept in rotation" in b.reason
    for _ in range(20):  # nor for errors
        b.record(False)
    assert b.state is State.CLOSED and b.ejections_withheld == 3  # one per min_calls (10) failures
    spare[0] = True
    for _ in range(10):
        b.record(False)
    assert b.state is State.OPEN  # another worker can take the traffic now
    b.observe(worker_pb2.WorkerStats())
    assert b.weight == 1.0  # recovered signals restore the weight


def test_the_pool_ejects_at_most_its_share_and_never_the_last_worker() -> None:
    pool = WorkerPool(RouterConfig(workers=("x:1",), breaker=BreakerConfig(max_ejection_percent=50)))
    for w in _workers(4):
        w.healthy = True
        pool.workers[w.address] = w
    addresses = list(pool.workers)
    assert pool.may_eject(addresses[0])
    pool.workers[addresses[0]].breaker.state = State.OPEN
    assert pool.may_eject(addresses[1])  # 2 of 4 out: 50%
    pool.workers[addresses[1]].breaker.state = State.OPEN
    assert not pool.may_eject(addresses[2])  # a third would exceed the share
    single = WorkerPool(RouterConfig(workers=("x:1",), breaker=BreakerConfig(max_ejection_percent=100)))
    (only,) = _workers(1)
    only.healthy = True
    single.workers[only.address] = only
    assert not single.may_eject(only.address)  # even at 100%: never the last worker


def test_a_degraded_worker_gets_less_traffic() -> None:
    ws = _workers(2)
    ws[0].breaker.degraded["attention_entropy_drift"] = 0.5
    picked = Counter(_picker().pick(ws, _req()).address for _ in range(10))  # type: ignore[union-attr]
    assert picked[ws[1].address] == 10  # equal loads: the healthy one wins every tie
    ws[1].outstanding_tokens = 100
    assert _picker().pick(ws, _req()) is ws[0]  # but a degraded idle worker beats a busy healthy one


class PoisonPicker(Picker):
    """A picker that fails on one affinity key: stands for any error while dispatching one job."""

    def pick(self, workers: list[Worker], job: Job) -> Worker | None:
        if job.affinity_key == "poison":
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        return super().pick(workers, job)


def test_an_error_dispatching_one_job_fails_that_job_alone() -> None:
    """The job stays at the head of the queue no more: it fails with the error, the jobs behind it are assigned,
    and /health's `failing` turns on only when every dispatch keeps failing."""

    async def go() -> None:
        d = RecordingDispatcher(RouterConfig(workers=("w:1",), max_wait_ms=0))
        d.picker = PoisonPicker(d.config)
        (w,) = _workers(1)
        d.pool.workers[w.address] = w
        loop = asyncio.get_running_loop()
        jobs = [_job(i) for i in range(3)]
        jobs[0].affinity_key = "poison"
        for j in jobs:
            j.assigned = loop.create_future()
            d.queues.put(j)
        d._dispatch()
        assert isinstance(jobs[0].assigned.exception(), UnicodeEncodeError)
        assert d.sent == [["j1"], ["j2"]] and len(d.queues) == 0
        assert d.failures == 1 and not d.failing
        poisoned = [_job(i) for i in range(10, 10 + FAILING_AFTER)]
        for j in poisoned:  # nothing but failures: the dispatcher says it is failing
            j.affinity_key, j.assigned = "poison", loop.create_future()
            d.queues.put(j)
        d._dispatch()
        assert d.failing and d.last_failure == "UnicodeEncodeError"
        assert all(isinstance(j.assigned.exception(), UnicodeEncodeError) for j in poisoned if j.assigned)
        ok = _job(99)
        ok.assigned = loop.create_future()
        d.queues.put(ok)
        d._dispatch()
        assert not d.failing and d.sent[-1] == ["j99"]

    asyncio.run(go())


def test_replay_skew_is_bounded_by_the_window() -> None:
    with pytest.raises(ConfigError, match="--replay-skew"):
        RouterConfig(workers=("w:1",), replay_window_s=60, replay_skew_s=61)
    assert RouterConfig(workers=("w:1",), replay_window_s=60, replay_skew_s=5).replay_skew_s == 5
