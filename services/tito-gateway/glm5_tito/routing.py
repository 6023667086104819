"""Rollout id -> data-parallel rank: consistent hashing over virtual nodes with bounded loads.

- String rollout ids become 64-bit ints through the first 16 hex digits of their sha256 (integer ids are used
  as they are), so UUID-style ids do not degrade the hash.
- Each rank owns `vnodes` points on the ring plus a reserve (default 20% more) that `rebalance` switches on
  for under-loaded ranks, so new rollouts drift towards them without moving any running rollout.
- Bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): no rank above max(ceil(m / n), floor(c * m / n)) for
  m = rollouts + 1 over n ranks (the floor keeps max/mean within c); a rollout whose point falls on a full rank
  moves along the ring to the next one with room.
- A rollout stays on its rank for all its turns (its prefix is cached there); when a rank goes away its
  rollouts are re-homed on their next turn, which re-prefills.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass, field

MASK64 = (1 << 64) - 1


def rollout_key(rollout_id: str) -> int:
    """The 64-bit id routing uses."""
    if rollout_id.isdigit() and int(rollout_id) <= MASK64:
        return int(rollout_id)
    return int(hashlib.sha256(rollout_id.encode()).hexdigest()[:16], 16)


def _mix(x: int) -> int:
    """splitmix64 finaliser: spreads sequential integer ids over the ring."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _point(rank: str, i: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{rank}#{i}".encode(), digest_size=8).digest(), "big")


@dataclass
class BoundedRing:
    vnodes: int = 64
    reserve: float = 0.2
    load_factor: float = 1.25
    loads: dict[str, int] = field(default_factory=dict)
    assigned: dict[int, str] = field(default_factory=dict)
    overflow_moves: int = 0
    rehomed: int = 0
    _active: dict[str, int] = field(default_factory=dict)  # vnodes switched on per rank
    _points: list[int] = field(default_factory=list)
    _owners: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.vnodes < 1 or not 0 <= self.reserve < 1 or self.load_factor < 1:
            raise ValueError("vnodes >= 1, 0 <= reserve < 1, load_factor >= 1")

    @property
    def ranks(self) -> list[str]:
        return sorted(self.loads)

    def add_rank(self, rank: str) -> None:
        if rank in self.loads:
            return
        self.loads[rank] = 0
        self._active[rank] = self.vnodes
        self._rebuild()

    def remove_rank(self, rank: str) -> None:
        """Its rollouts lose their home and are re-homed on their next turn."""
        if rank not in self.loads:
            return
        del self.loads[rank]
        del self._active[rank]
        for key in [k for k, r in self.assigned.items() if r == rank]:
            del self.assigned[key]
            self.rehomed += 1
        self._rebuild()

    def rebalance(self) -> None:
        """Switch the reserve vnodes on for ranks below the mean load, off for the others."""
        if not self.loads:
            return
        mean = sum(self.loads.values()) / len(self.loads)
        extra = math.ceil(self.vnodes * self.reserve / (1 - self.reserve)) if self.reserve else 0
        for rank, load in self.loads.items():
            self._active[rank] = self.vnodes + (extra if load < mean else 0)
        self._rebuild()

    def _rebuild(self) -> None:
        pairs = sorted((_point(r, i), r) for r, n in self._active.items() for i in range(n))
        self._points = [p for p, _ in pairs]
        self._owners = [r for _, r in pairs]

    def lookup(self, key: int) -> str:
        """The rank of a rollout: its current home, or a new one within the load bound."""
        home = self.assigned.get(key)
        if home is not None:
            return home
        if not self._points:
            raise LookupError("no rollout engine is available")
        # floor(c * load / ranks) keeps max/mean within c; ceil(load / ranks) guarantees there is room.
        total, n = sum(self.loads.values()) + 1, len(self.loads)
        bound = max(math.ceil(total / n), math.floor(self.load_factor * total / n))
        start = bisect.bisect(self._points, _mix(key)) % len(self._points)
        tried: set[str] = set()
        for i in range(len(self._points)):
            rank = self._owners[(start + i) % len(self._points)]
            if rank in tried:
                continue
            if self.loads[rank] < bound:
                if tried:
                    self.overflow_moves += 1
                self.assigned[key] = rank
                self.loads[rank] += 1
                return rank
            tried.add(rank)
            if len(tried) == len(self.loads):
                break
        raise AssertionError("the load bound always leaves room on some rank")

    def release(self, key: int) -> None:
        """A finished rollout frees its slot."""
        rank = self.assigned.pop(key, None)
        if rank is not None and rank in self.loads:
            self.loads[rank] -= 1
