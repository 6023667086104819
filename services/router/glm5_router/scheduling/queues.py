"""Three lanes. Short: prompts under --short-max-prompt-tokens, FIFO by arrival, served first; medium: FIFO
after them; long (from --long-min-prompt-tokens): ordered by estimated KV cost and paused while the workers
report KV usage above --long-pause-kv-usage."""

from __future__ import annotations

import collections
import heapq
import itertools

from glm5.errors import CapacityError

from glm5_router.scheduling.job import Job


class InProcessQueues:
    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self._short: collections.deque[Job] = collections.deque()
        self._medium: collections.deque[Job] = collections.deque()
        self._long: list[tuple[int, int, Job]] = []
        self._seq = itertools.count()
        self._live = 0  # queued jobs that have not been discarded

    def __len__(self) -> int:
        return self._live

    def depth(self) -> dict[str, int]:
        return {"short": len(self._short), "medium": len(self._medium), "long": len(self._long)}

    def put(self, job: Job, front: bool = False) -> None:
        """Queue a job; `front` puts a retried job back at the head of its lane. Full -> CapacityError."""
        if not front and len(self) >= self.max_queued:
            raise CapacityError(f"the router's queue is full ({self.max_queued} requests); retry later")
        job.queued = True
        self._live += 1
        if job.lane == "long":
            # Retries go first: a negative sequence sorts before every cost-ordered entry of equal cost.
            heapq.heappush(self._long, (job.kv_cost if not front else -1, next(self._seq), job))
        else:
            lane = self._short if job.lane == "short" else self._medium
            lane.appendleft(job) if front else lane.append(job)

    def peek(self, long_paused: bool) -> Job | None:
        for lane in (self._short, self._medium):
            while lane and lane[0].done:
                lane.popleft()  # cancelled or expired while queued
            if lane:
                return lane[0]
        while self._long and self._long[0][2].done:
            heapq.heappop(self._long)
        if self._long and not long_paused:
            return self._long[0][2]
        return None

    def pop(self, job: Job) -> None:
        """Remove `job`, which `peek` just returned."""
        job.queued = False
        self._live -= 1
        if self._short and self._short[0] is job:
            self._short.popleft()
        elif self._medium and self._medium[0] is job:
            self._medium.popleft()
        else:
            assert self._long and self._long[0][2] is job, "pop() follows peek()"
            heapq.heappop(self._long)

    def discard(self, job: Job) -> None:
        """Forget a job that will not run (the lazy `done` check drops it when it reaches the head)."""
        job.done = True
        if job.queued:
            job.queued = False
            self._live -= 1
