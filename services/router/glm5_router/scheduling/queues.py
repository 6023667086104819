"""Three lanes. Short: prompts under --short-max-prompt-tokens, FIFO by arrival, served first; medium: FIFO
after them; long (from --long-min-prompt-tokens): ordered by estimated KV cost and paused while the workers
report KV usage above --long-pause-kv-usage.

The order is written once, as two sorted queues and a score per job (`lane_score`), and the pause once
(`long_paused`): the in-process queues and the shared Redis queues (scheduling/redis_queue.py) both keep them."""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from glm5.errors import CapacityError

from glm5_router.scheduling.job import Job

if TYPE_CHECKING:
    from glm5_router.workers.pool import Worker

SHORT, LONG = "queue:short", "queue:long"  # short and medium share the first: medium sorts after every short
MEDIUM_OFFSET = 1e12  # added to a medium job's arrival (seconds, either clock)


def lane_score(job: Job, arrival: float, front: bool = False) -> tuple[str, float]:
    """(queue, score) of a job that arrived at `arrival`: the lowest score of the first queue is served first,
    then the second's unless the long lane is paused. `front`: a retried job, ahead of its lane's others."""
    if job.lane == "long":
        return LONG, -1.0 if front else float(job.kv_cost)
    base = MEDIUM_OFFSET if job.lane == "medium" else 0.0
    return SHORT, base - 1.0 if front else base + arrival


def long_paused(workers: Sequence[Worker], kv_usage: float) -> bool:
    """The long lane waits while every routable worker's KV cache is fuller than `kv_usage`."""
    return bool(workers) and min(w.kv_usage for w in workers) > kv_usage


class InProcessQueues:
    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self._queues: dict[str, list[tuple[float, int, Job]]] = {SHORT: [], LONG: []}
        self._seq = itertools.count()  # FIFO among equal scores
        self._live: collections.Counter[str] = collections.Counter()  # queued jobs not discarded, per lane

    def __len__(self) -> int:
        return sum(self._live.values())

    def depth(self) -> dict[str, int]:
        return {lane: self._live[lane] for lane in ("short", "medium", "long")}

    def put(self, job: Job, front: bool = False) -> None:
        """Queue a job; `front` puts a retried job back at the head of its lane. Full -> CapacityError."""
        if not front and len(self) >= self.max_queued:
            raise CapacityError(f"the router's queue is full ({self.max_queued} requests); retry later")
        job.queued = True
        self._live[job.lane] += 1
        queue, score = lane_score(job, job.arrival, front)
        heapq.heappush(self._queues[queue], (score, next(self._seq), job))

    def peek(self, long_paused: bool) -> Job | None:
        for name in (SHORT, LONG):
            queue = self._queues[name]
            while queue and queue[0][2].done:
                heapq.heappop(queue)  # cancelled or expired while queued
            if queue and (name == SHORT or not long_paused):
                return queue[0][2]
        return None

    def pop(self, job: Job) -> None:
        """Remove `job`, which `peek` just returned."""
        queue = self._queues[lane_score(job, job.arrival)[0]]
        assert queue and queue[0][2] is job, "pop() follows peek()"
        heapq.heappop(queue)
        job.queued = False
        self._live[job.lane] -= 1

    def discard(self, job: Job) -> None:
        """Forget a job that will not run (the lazy `done` check drops it when it reaches the head)."""
        job.done = True
        if job.queued:
            job.queued = False
            self._live[job.lane] -= 1
