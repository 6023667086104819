"""A training step's batch: rollout records taken from the buffer (Redis, or the gateway's own) are held per GRPO
group until the group has every record its rollouts wrote, then selected (stale / failed / malformed samples
dropped, groups with more than half valid padded: glm5.rl.samples.select)."""

from __future__ import annotations

import collections
from collections.abc import Callable

from glm5.rl.buffer import RedisBuffer
from glm5.rl.samples import select
from glm5.v1 import tito_pb2, tito_pb2_grpc

from glm5_trainer.config import RLConfig

TAKE_RECORDS, TAKE_TIMEOUT_S = 256, 0.5  # records per read of the buffer, and how long a read waits


class BatchAssembler:
    def __init__(self, config: RLConfig, run_id: str, counters: collections.Counter[str]) -> None:
        self.c, self.run_id, self.counters = config, run_id, counters
        self.pending: dict[str, list[tito_pb2.RolloutRecord]] = collections.defaultdict(list)
        self.finished_groups: dict[str, int] = {}  # group id -> records its rollouts wrote
        self.buffer: RedisBuffer | None = None  # else the gateway's TakeRollouts
        self.gateway: tito_pb2_grpc.TitoGatewayStub | None = None

    def group_finished(self, group_id: str, records: int) -> None:
        self.finished_groups[group_id] = records

    async def _take(self, n: int, timeout: float) -> list[tito_pb2.RolloutRecord]:
        if self.buffer is not None:
            return await self.buffer.take(n, timeout)
        assert self.gateway is not None
        resp = await self.gateway.TakeRollouts(
            tito_pb2.TakeRolloutsRequest(max_records=n, timeout_ms=int(timeout * 1000))
        )
        return list(resp.records)

    async def next_batch(self, latest_version: int, check: Callable[[], None]) -> list[tito_pb2.RolloutRecord]:
        """`groups_per_step` complete groups that pass selection against `latest_version`; `check` runs before
        each read (it raises when nothing will ever arrive: the rollout producer died)."""
        accepted: list[list[tito_pb2.RolloutRecord]] = []
        while len(accepted) < self.c.groups_per_step:
            check()
            for r in await self._take(TAKE_RECORDS, TAKE_TIMEOUT_S):
                if r.group_id.startswith(self.run_id + "-"):
                    self.pending[r.group_id].append(r)
                else:
                    self.counters["dropped_foreign"] += 1  # another run's record (a shared Redis stream)
            for gid in list(self.pending):
                if len(accepted) == self.c.groups_per_step:
                    break
                expected = self.finished_groups.get(gid)
                if expected is None or len(self.pending[gid]) < expected:
                    continue  # the group is still generating
                records = self.pending.pop(gid)
                del self.finished_groups[gid]
                sel = select(records, latest_version, self.c.staleness_limit, self.c.group_size)
                self.counters.update({f"dropped_{k}": v for k, v in sel.dropped.items()})
                self.counters["padded"] += sel.padded
                if sel.samples:
                    accepted.append(sel.samples)
            for gid in [g for g, n in self.finished_groups.items() if n == 0]:
                del self.finished_groups[gid]  # every rollout of it was lost: nothing will arrive
        return [r for group in accepted for r in group]
