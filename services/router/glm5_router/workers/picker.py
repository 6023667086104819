"""Which worker gets a request (--routing):

- kv (the default): the worker that holds most of the prompt in its prefix cache, weighed with its load. The
  router's CacheIndex says, per worker, how many of the prompt's leading blocks it holds (from the workers' cache
  events and the router's own dispatches); each worker scores
  w_prefix * cached share of the prompt + w_load * (1 - its outstanding tokens / the most any candidate has)
  + w_kv * (1 - its KV usage), times its breaker weight (a degraded worker counts for less). Like llm-d's scorers,
  each term lies in [0, 1]; the default weights (3, 1, 1) let a cached prefix win over a small load difference.
  Bounded load as below keeps a hot prefix from piling onto one worker: the overflow goes to the next best score.
- load: least outstanding tokens, weighted by the breaker's soft signals (ties go round-robin, so an idle pool
  spreads sequential requests).
- session: with an affinity key (a session id, or a hash of the prompt's first 64 tokens) rendezvous hashing
  keeps a key on one worker, with bounded load: no worker above ceil(c * (in-flight + 1) / workers), so a hot
  session cannot pile onto one worker; without one, as load.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Protocol

from glm5_router.config import RouterConfig
from glm5_router.workers.cache_index import CacheIndex
from glm5_router.workers.pool import Worker

KV_SLACK = 1  # kv routing lets a worker one request past the bound: a burst sharing a prefix stays together


def _score(key: str, address: str) -> int:
    data = f"{key}\0{address}".encode("utf-8", "surrogatepass")  # any str hashes; intake refuses such keys anyway
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Routable(Protocol):
    """What a picker reads of a request (scheduling.job.Job is one): the workers layer sits below scheduling."""

    prompt_tokens: int
    affinity_key: str | None

    def block_hashes(self, block_size: int) -> list[bytes]: ...


@dataclass
class RoutedTokens:
    """What kv routing predicted: prompt tokens routed, and those the chosen worker held (a hit-rate estimate)."""

    prompt: int = 0
    cached: int = 0


class Picker:
    def __init__(self, config: RouterConfig, index: CacheIndex | None = None) -> None:
        self.mode = config.routing
        self.load_factor = config.affinity_load_factor
        self.weights = config.kv_weights
        self.index = index
        self.routed = RoutedTokens()
        self._turn = itertools.count()

    def pick(self, workers: list[Worker], job: Routable) -> Worker | None:
        """The worker to use now, or None when every candidate refuses (breakers). Under kv routing the chosen
        worker is recorded in the index as holding the prompt's blocks (it will, once it has prefilled)."""
        if not workers:
            return None
        if self.mode == "kv" and self.index is not None:
            order, hits = self._by_cache(workers, job)
        elif self.mode == "session" and job.affinity_key:
            order, hits = self._bounded(sorted(workers, key=lambda w: _score(job.affinity_key or "", w.address),
                                               reverse=True)), {}  # fmt: skip
        else:
            order, hits = self._by_load(workers), {}
        for w in order:
            if w.breaker.allow():
                if self.index is not None and self.mode == "kv" and w.cache_block_size:
                    self.index.add(w.address, job.block_hashes(w.cache_block_size))
                    self.routed.prompt += job.prompt_tokens
                    self.routed.cached += hits.get(w.address, 0)
                return w
        return None

    def _rotated(self, workers: list[Worker]) -> list[Worker]:
        turn = next(self._turn)
        ring = sorted(workers, key=lambda w: w.address)
        return ring[turn % len(ring) :] + ring[: turn % len(ring)]

    def _by_load(self, workers: list[Worker]) -> list[Worker]:
        # a degraded worker (soft signals over threshold) looks as loaded as its weight says
        return sorted(self._rotated(workers), key=lambda w: ((w.outstanding_tokens + 1) / w.breaker.weight,
                                                            w.in_flight / w.breaker.weight))  # fmt: skip  # ties rotate

    def _bounded(self, ranked: list[Worker], slack: int = 0) -> list[Worker]:
        """`ranked` with the workers at the load bound (plus `slack` requests) moved to the end (in their order)."""
        total = sum(w.in_flight for w in ranked)
        bound = math.ceil(self.load_factor * (total + 1) / len(ranked)) + slack
        return [w for w in ranked if w.in_flight + 1 <= bound] + [w for w in ranked if w.in_flight + 1 > bound]

    def _by_cache(self, workers: list[Worker], job: Routable) -> tuple[list[Worker], dict[str, int]]:
        assert self.index is not None
        hits: dict[str, int] = {}
        for size in {w.cache_block_size for w in workers if w.cache_block_size}:
            same = [w.address for w in workers if w.cache_block_size == size]
            for address, blocks in self.index.matched(job.block_hashes(size), same).items():
                hits[address] = blocks * size
        w_prefix, w_load, w_kv = self.weights
        most = max(w.outstanding_tokens for w in workers)
        prompt = max(job.prompt_tokens, 1)

        def score(w: Worker) -> float:
            load = w.outstanding_tokens / most if most else 0.0
            value = w_prefix * hits.get(w.address, 0) / prompt + w_load * (1 - load) + w_kv * (1 - w.kv_usage)
            return value * w.breaker.weight

        return self._bounded(sorted(self._rotated(workers), key=score, reverse=True), KV_SLACK), hits  # ties rotate
