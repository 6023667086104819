"""The rollout buffer between the TITO gateway (writer) and the trainer (reader): a Redis stream when a URL is
given (`glm5:rollouts`, records as serialised protobuf), in-process otherwise."""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Protocol

from glm5.v1 import tito_pb2

STREAM = "glm5:rollouts"


class RolloutBuffer(Protocol):
    async def put(self, record: tito_pb2.RolloutRecord) -> None: ...

    async def take(self, n: int, timeout: float) -> list[tito_pb2.RolloutRecord]: ...


class InProcessBuffer:
    def __init__(self, max_records: int = 100000) -> None:
        self._records: collections.deque[tito_pb2.RolloutRecord] = collections.deque(maxlen=max_records)
        self._added = asyncio.Event()

    def __len__(self) -> int:
        return len(self._records)

    async def put(self, record: tito_pb2.RolloutRecord) -> None:
        self._records.append(record)
        self._added.set()

    async def take(self, n: int, timeout: float) -> list[tito_pb2.RolloutRecord]:
        """Up to `n` records, waiting at most `timeout` seconds for the first."""
        if not self._records:
            self._added.clear()
            try:
                await asyncio.wait_for(self._added.wait(), timeout)
            except TimeoutError:
                return []
        return [self._records.popleft() for _ in range(min(n, len(self._records)))]


class RedisBuffer:
    def __init__(self, url: str, max_records: int = 100000) -> None:
        import redis.asyncio as aioredis

        self.redis: Any = aioredis.from_url(url)
        self.max_records = max_records
        self._last = "0-0"

    async def put(self, record: tito_pb2.RolloutRecord) -> None:
        await self.redis.xadd(STREAM, {"r": record.SerializeToString()}, maxlen=self.max_records, approximate=True)

    async def take(self, n: int, timeout: float) -> list[tito_pb2.RolloutRecord]:
        entries = await self.redis.xread({STREAM: self._last}, count=n, block=max(1, int(timeout * 1000)))
        out = []
        for _, items in entries or []:
            for entry_id, fields in items:
                self._last = entry_id
                rec = tito_pb2.RolloutRecord()
                rec.ParseFromString(fields[b"r"])
                out.append(rec)
        return out
