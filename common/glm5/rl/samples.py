"""Which rollouts a training step may use.

- Malformed records (lengths that disagree, a loss mask outside {0, 1}, no model token) are rejected with the
  reason: the trainer never silently trains on them.
- Failed environments are excluded; a sample whose oldest model token's weight version (a turn can span a
  weight swap) is more than `tau` versions behind the current policy is dropped (too stale for the
  importance-sampling correction).
- Groups (GRPO): a group with more than half of its expected samples valid is padded to full size by
  repeating valid samples (in order); otherwise the whole group is dropped.
Every drop is counted by reason.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from glm5.v1 import tito_pb2


def problems(r: tito_pb2.RolloutRecord) -> list[str]:
    out = []
    n = len(r.token_ids)
    for name in ("loss_mask", "logprobs", "token_versions"):
        if len(getattr(r, name)) != n:
            out.append(f"{name} has {len(getattr(r, name))} entries for {n} tokens")
    if any(m not in (0, 1) for m in r.loss_mask):
        out.append("loss_mask holds values other than 0 and 1")
    if not any(r.loss_mask):
        out.append("no model-generated token")
    if not r.turn_versions:
        out.append("no turn versions")
    return out


def oldest_version(r: tito_pb2.RolloutRecord) -> int:
    return int(min(v for v, m in zip(r.token_versions, r.loss_mask, strict=True) if m))


@dataclass
class Selection:
    samples: list[tito_pb2.RolloutRecord] = field(default_factory=list)
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    padded: int = 0


def select(records: list[tito_pb2.RolloutRecord], current_version: int, tau: int, group_size: int) -> Selection:
    sel = Selection()
    groups: dict[str, list[tito_pb2.RolloutRecord]] = collections.defaultdict(list)
    for r in records:
        if problems(r):
            sel.dropped["malformed"] += 1
        elif r.status == tito_pb2.ROLLOUT_STATUS_FAILED:
            sel.dropped["environment_failed"] += 1
        elif current_version - oldest_version(r) > tau:
            sel.dropped["stale"] += 1
        else:
            groups[r.group_id].append(r)
    for _, valid in sorted(groups.items()):
        if len(valid) * 2 <= group_size:
            sel.dropped["incomplete_group"] += len(valid)
            continue
        valid = valid[:group_size]
        pad = [valid[i % len(valid)] for i in range(group_size - len(valid))]
        sel.padded += len(pad)
        sel.samples += valid + pad
    return sel
