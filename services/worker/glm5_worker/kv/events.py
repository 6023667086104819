"""What the prefix cache stores and evicts, for routers (issue 37): a bounded log of block hashes stored and
removed, each with a sequence number, under an epoch that changes when the cache starts over (a restart, or a
weight swap that drops every cached block). A router that applied everything up to (epoch, seq) asks for what
came after; one that missed more than the log holds, or whose epoch is not the current one, gets a snapshot of
every hash held instead, so its index never drifts from the worker's cache for good."""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_LOG_EVENTS = 65536  # 16-byte hashes: ~1 MiB of log; a router polling every second falls behind only
# when a worker stores or evicts more than that many blocks a second


@dataclass(frozen=True, slots=True)
class CacheDelta:
    """The change since (epoch, after): the net effect of the events, or (snapshot) every hash held now."""

    epoch: int
    after: int
    seq: int  # the latest event's number: ask after it next time
    snapshot: bool
    stored: list[bytes]
    removed: list[bytes]


class CacheEvents:
    def __init__(self, capacity: int = DEFAULT_LOG_EVENTS) -> None:
        if capacity < 1:
            raise ValueError("the cache event log needs room for at least one event")
        self.epoch = self._new_epoch()
        self.seq = 0
        self._log: deque[tuple[int, bool, bytes]] = deque(maxlen=capacity)

    @staticmethod
    def _new_epoch() -> int:
        return secrets.randbits(62) + 1  # never 0: a router that has applied nothing asks with epoch 0

    def stored(self, h: bytes) -> None:
        self.seq += 1
        self._log.append((self.seq, True, h))

    def removed(self, h: bytes) -> None:
        self.seq += 1
        self._log.append((self.seq, False, h))

    def restart(self) -> None:
        """The cache starts over (every block dropped): a new epoch, so every router resynchronises."""
        self.epoch, self.seq = self._new_epoch(), 0
        self._log.clear()

    def since(self, epoch: int, after: int, held: Iterable[bytes]) -> CacheDelta:
        """What a router that applied (epoch, after) needs; `held`: the hashes cached now (for a snapshot)."""
        first = self._log[0][0] if self._log else self.seq + 1
        if epoch != self.epoch or after > self.seq or after + 1 < first:
            return CacheDelta(self.epoch, after, self.seq, True, list(held), [])
        last: dict[bytes, bool] = {}  # net effect: a hash's last event decides
        for _, stored, h in itertools.islice(self._log, after + 1 - first, None):
            last[h] = stored
        return CacheDelta(self.epoch, after, self.seq, False, [h for h, s in last.items() if s],
                          [h for h, s in last.items() if not s])  # fmt: skip
