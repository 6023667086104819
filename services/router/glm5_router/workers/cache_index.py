"""Which worker holds which prefix blocks (issue 37): block hash -> workers, from the workers' own cache events
(Worker.GetStats cache_events: deltas in order, a snapshot after a gap, a restart or a weight swap) and from the
router's own dispatches (a request sent to a worker will leave its prompt's blocks there: recorded at once, so
the next request with that prefix finds them before the worker's next poll reports them). Bounded: at most
`capacity` hashes, the least recently stored or matched forgotten first (it only costs a routing guess)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from glm5.v1 import worker_pb2


class CacheIndex:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the cache index needs room for at least one block")
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()
        self._held: dict[str, set[bytes]] = {}
        self._cursor: dict[str, tuple[int, int]] = {}  # worker -> (epoch, seq) of the events applied
        self.evictions = 0  # hashes forgotten for room
        self.resyncs: dict[str, int] = {}  # snapshots applied per worker (its first one included)

    def __len__(self) -> int:
        return len(self._holders)

    def cursor(self, address: str) -> tuple[int, int]:
        """(epoch, seq) to ask the worker for events after: (0, 0) before its first snapshot."""
        return self._cursor.get(address, (0, 0))

    def held_by(self, address: str) -> set[bytes]:
        return set(self._held.get(address, ()))

    def apply(self, address: str, events: worker_pb2.CacheEvents) -> bool:
        """Applies a worker's events if they follow what was applied (a snapshot always does); False (ignored)
        for a delta after another point, e.g. a stale answer meant for another router."""
        if events.snapshot:
            self.drop(address)
            self.resyncs[address] = self.resyncs.get(address, 0) + 1
            self.add(address, events.stored)
        elif (events.epoch, events.after) == self.cursor(address):
            held = self._held.get(address)
            for h in events.removed:
                if held is not None and h in held:
                    held.discard(h)
                    holders = self._holders[h]
                    holders.discard(address)
                    if not holders:
                        del self._holders[h]
            self.add(address, events.stored)
        else:
            return False
        self._cursor[address] = (events.epoch, events.seq)
        return True

    def add(self, address: str, hashes: Iterable[bytes]) -> None:
        held = self._held.setdefault(address, set())
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = set()
            else:
                self._holders.move_to_end(h)
            holders.add(address)
            held.add(h)
        while len(self._holders) > self.capacity:
            h, holders = self._holders.popitem(last=False)
            for a in holders:
                self._held[a].discard(h)
            self.evictions += 1

    def drop(self, address: str) -> None:
        """Forgets everything about a worker (removed from the pool, or before its snapshot)."""
        for h in self._held.pop(address, set()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(address)
                if not holders:
                    del self._holders[h]
        self._cursor.pop(address, None)

    def matched(self, hashes: Sequence[bytes], addresses: Iterable[str]) -> dict[str, int]:
        """Per worker, how many of the prompt's leading blocks it holds (a prefix cache reuses a prefix only)."""
        alive = set(addresses)
        counts = dict.fromkeys(alive, 0)
        for j, h in enumerate(hashes):
            holders = self._holders.get(h)
            still = alive & holders if holders else set()
            if not still:
                break
            self._holders.move_to_end(h)
            for a in still:
                counts[a] = j + 1
            alive = still
        return counts
