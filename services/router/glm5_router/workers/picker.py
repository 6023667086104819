"""Which worker gets a request: least outstanding tokens by default, weighted by the breaker's soft signals
(ties go round-robin, so an idle pool spreads sequential requests); with an affinity key (session id, or a
hash of the prompt's first block) rendezvous hashing keeps a key on one worker, with bounded load: no worker
above ceil(c * (in-flight + 1) / workers), so a hot session cannot pile onto one worker."""

from __future__ import annotations

import hashlib
import itertools
import math

from glm5_router.workers.pool import Worker


def _score(key: str, address: str) -> int:
    data = f"{key}\0{address}".encode("utf-8", "surrogatepass")  # any str hashes; intake refuses such keys anyway
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Picker:
    def __init__(self, load_factor: float) -> None:
        self.load_factor = load_factor
        self._turn = itertools.count()

    def pick(self, workers: list[Worker], affinity_key: str | None) -> Worker | None:
        """The worker to use now, or None when every candidate refuses (breakers)."""
        if not workers:
            return None
        if affinity_key:
            total = sum(w.in_flight for w in workers)
            bound = math.ceil(self.load_factor * (total + 1) / len(workers))
            ranked = sorted(workers, key=lambda w: _score(affinity_key, w.address), reverse=True)
            order = [w for w in ranked if w.in_flight + 1 <= bound] + [w for w in ranked if w.in_flight + 1 > bound]
        else:
            turn = next(self._turn)
            ring = sorted(workers, key=lambda w: w.address)
            rotated = ring[turn % len(ring) :] + ring[: turn % len(ring)]
            # a degraded worker (soft signals over threshold) looks as loaded as its weight says
            order = sorted(rotated, key=lambda w: ((w.outstanding_tokens + 1) / w.breaker.weight,
                                                   w.in_flight / w.breaker.weight))  # fmt: skip  # ties rotate
        for w in order:
            if w.breaker.allow():
                return w
        return None
