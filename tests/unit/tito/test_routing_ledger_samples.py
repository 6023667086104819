"""Rollout routing (bounded-load consistent hashing), the token ledger, and sample selection."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from glm5.rl.samples import problems, select
from glm5.v1 import tito_pb2
from glm5_tito.ledger import Ledger, LedgerMismatch
from glm5_tito.routing import BoundedRing, rollout_key


def test_rollout_keys() -> None:
    uid = "6f1c1a52-7a52-4c1e-9d2e-3b4f0f9b8c11"
    assert rollout_key(uid) == int(hashlib.sha256(uid.encode()).hexdigest()[:16], 16)
    assert rollout_key("12345") == 12345 and rollout_key(str(2**64)) != 2**64


@pytest.mark.parametrize("ranks", [8, 16, 64])
def test_bounded_load_and_stickiness(ranks: int) -> None:
    ring = BoundedRing(load_factor=1.25)
    for r in range(ranks):
        ring.add_rank(f"rank-{r}")
    keys = [rollout_key(f"rollout-{i}") for i in range(1000)]
    homes = {k: ring.lookup(k) for k in keys}
    loads = Counter(homes.values())
    assert max(loads.values()) / (1000 / ranks) <= 1.25  # max/mean within the load factor
    assert all(ring.lookup(k) == homes[k] for k in keys)  # every later turn goes to the same rank
    ring.release(keys[0])
    assert sum(ring.loads.values()) == 999


def test_removed_rank_rehomes_only_its_rollouts() -> None:
    ring = BoundedRing()
    for r in range(4):
        ring.add_rank(f"r{r}")
    keys = [rollout_key(f"x{i}") for i in range(200)]
    before = {k: ring.lookup(k) for k in keys}
    ring.remove_rank("r1")
    after = {k: ring.lookup(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r1" for k in moved)  # nobody else moved
    assert "r1" not in after.values() and ring.rehomed == len(moved)


def test_group_spreads_and_reserve_favours_light_ranks() -> None:
    ring = BoundedRing(vnodes=16, reserve=0.2)
    for r in range(8):
        ring.add_rank(f"r{r}")
    group = [ring.lookup(rollout_key(f"group-7/sample-{i}")) for i in range(8)]
    assert len(set(group)) >= 4  # one GRPO group is not pinned on one rank
    ring.add_rank("new")
    ring.rebalance()  # the new, empty rank gets its reserve points switched on
    assert ring._active["new"] == max(ring._active.values()) > min(ring._active.values())
    with pytest.raises(ValueError):
        BoundedRing(reserve=1.0)


def test_ledger_extends_and_rejects_rewrites() -> None:
    led = Ledger("r1", 1, "g")
    assert led.extend_context([1, 2, 3]) == 3 and led.prompt_tokens == 3
    led.add_generated([7, 8], [-0.5, -0.25], version=4)
    assert led.extend_context([1, 2, 3, 7, 8, 9]) == 1  # a tool result appended
    assert led.mask == [0, 0, 0, 1, 1, 0] and led.logprobs[3:5] == [-0.5, -0.25]
    assert led.token_versions == [0, 0, 0, 4, 4, 0]
    with pytest.raises(LedgerMismatch, match="position 3"):
        led.extend_context([1, 2, 3, 99, 8, 9, 10])  # a template that rewrote an earlier turn
    with pytest.raises(LedgerMismatch):
        led.extend_context([1, 2])


def _rec(
    rid: str, group: str, versions: list[int], status: int = tito_pb2.ROLLOUT_STATUS_COMPLETED
) -> tito_pb2.RolloutRecord:
    return tito_pb2.RolloutRecord(rollout_id=rid, group_id=group, token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                                  logprobs=[0, -1, -1], token_versions=[0, versions[0], versions[-1]],
                                  turn_versions=versions, status=status)  # fmt: skip


def test_select_staleness_failures_and_group_padding() -> None:
    records = [
        _rec("a1", "A", [10]), _rec("a2", "A", [9]), _rec("a5", "A", [8]),
        _rec("a3", "A", [5, 10]),  # oldest turn too stale
        _rec("a4", "A", [10], tito_pb2.ROLLOUT_STATUS_FAILED),
        _rec("b1", "B", [10]),  # B: 1 of 4 valid -> dropped
        _rec("c1", "C", [10]), _rec("c2", "C", [10]), _rec("c3", "C", [10]), _rec("c4", "C", [8]),
    ]  # fmt: skip
    bad = tito_pb2.RolloutRecord(rollout_id="m", group_id="C", token_ids=[1, 2], loss_mask=[0], turn_versions=[10])
    sel = select([*records, bad], current_version=10, tau=2, group_size=4)
    ids = [r.rollout_id for r in sel.samples]
    assert ids == ["a1", "a2", "a5", "a1", "c1", "c2", "c3", "c4"]  # A: 3 of 4 valid, padded by repeating
    assert sel.padded == 1
    assert sel.dropped == Counter({"stale": 1, "environment_failed": 1, "incomplete_group": 1, "malformed": 1})
    assert "loss_mask has 1 entries for 2 tokens" in problems(bad)[0]
