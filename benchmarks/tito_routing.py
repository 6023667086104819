"""Rollout routing balance and stickiness: the gateway's bounded-load consistent hashing against plain modulo
and plain consistent hashing (results in docs/benchmarks.md).

    python -m benchmarks.tito_routing [--rollouts 1000] [--turns 4] [--seeds 5]
    python -m benchmarks.tito_routing --smoke      # 200 rollouts x 3 turns, one seed: the table in a second

Each rollout takes `turns` turns. "max/mean" is the most loaded rank's running rollouts over the mean (lower
is better; the target is <= 1.25). "stickiness" is the share of turns after the first that go to the same
rank as the rollout's first turn while ranks come and go: one rank leaves after the first turn and one
joins after the second, as in a live job (target >= 95%). Modulo rehashes almost everything on a change.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import time
from collections import Counter
from collections.abc import Callable

from glm5_tito.routing import BoundedRing, _mix, _point, rollout_key


class Modulo:
    def __init__(self) -> None:
        self.ranks: list[str] = []

    def add_rank(self, r: str) -> None:
        self.ranks = sorted({*self.ranks, r})

    def remove_rank(self, r: str) -> None:
        self.ranks = [x for x in self.ranks if x != r]

    def lookup(self, key: int) -> str:
        return self.ranks[_mix(key) % len(self.ranks)]


class PlainRing:
    """Consistent hashing with virtual nodes, no load bound, no memory of assignments."""

    def __init__(self, vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self.pairs: list[tuple[int, str]] = []
        self.points: list[int] = []

    def add_rank(self, r: str) -> None:
        self.pairs = sorted([*self.pairs, *((_point(r, i), r) for i in range(self.vnodes))])
        self.points = [p for p, _ in self.pairs]

    def remove_rank(self, r: str) -> None:
        self.pairs = [p for p in self.pairs if p[1] != r]
        self.points = [p for p, _ in self.pairs]

    def lookup(self, key: int) -> str:
        return self.pairs[bisect.bisect(self.points, _mix(key)) % len(self.pairs)][1]


def simulate(
    make: Callable[[], object], ranks: int, rollouts: int, turns: int, seed: int
) -> tuple[float, float, float]:
    router = make()
    for r in range(ranks):
        router.add_rank(f"rank-{r}")  # type: ignore[attr-defined]
    keys = [rollout_key(f"seed{seed}/group{i // 8}/sample{i % 8}") for i in range(rollouts)]
    first = {k: router.lookup(k) for k in keys}  # type: ignore[attr-defined]
    loads = Counter(first.values())
    imbalance = max(loads.values()) / (rollouts / ranks)
    same = total = 0
    t = time.perf_counter()
    lookups = 0
    for turn in range(1, turns):
        if turn == 1:
            router.remove_rank("rank-0")  # type: ignore[attr-defined]
        if turn == 2:
            router.add_rank(f"rank-{ranks}")  # type: ignore[attr-defined]
        for k in keys:
            r = router.lookup(k)  # type: ignore[attr-defined]
            lookups += 1
            if first[k] != "rank-0":  # rollouts whose rank left must move: not counted
                total += 1
                same += r == first[k]
    lookup_us = (time.perf_counter() - t) / lookups * 1e6
    return imbalance, same / total, lookup_us


def main(rollouts: int, turns: int, seeds: int, smoke: bool = False) -> None:
    routers: dict[str, Callable[[], object]] = {
        "modulo": Modulo,
        "consistent hashing": PlainRing,
        "bounded-load ring (gateway)": lambda: BoundedRing(vnodes=64, reserve=0.2, load_factor=1.25),
    }
    print(f"{rollouts} rollouts x {turns} turns, groups of 8, one rank leaves after turn 1 and one joins after "
          f"turn 2; medians over {seeds} seeds")  # fmt: skip
    print(f"{'ranks':>6}  {'router':<30}{'max/mean':>10}{'stickiness':>12}{'lookup us':>11}")
    table = 0
    for ranks in (8, 16, 64):
        for name, make in routers.items():
            rows = [simulate(make, ranks, rollouts, turns, s) for s in range(seeds)]
            imb = statistics.median(r[0] for r in rows)
            stick = statistics.median(r[1] for r in rows)
            us = statistics.median(r[2] for r in rows)
            print(f"{ranks:>6}  {name:<30}{imb:10.3f}{stick:11.1%}{us:11.2f}")
            table += 1
    if smoke:  # the table, not the figures
        assert table == 9, table
        print("smoke: ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="200 rollouts x 3 turns, one seed")
    a = parser.parse_args()
    if a.smoke:
        a.rollouts, a.turns, a.seeds = 200, 3, 1
    main(a.rollouts, a.turns, a.seeds, a.smoke)
