"""The prefix cache's events for routers (issue 37, item 1): every hash the block manager starts or stops
holding is logged with a sequence number; a router that applied (epoch, seq) gets the net change after it, or a
snapshot after a gap (more events than the log keeps), a restart or a weight swap (a new epoch)."""

from __future__ import annotations

from glm5.kvcache.prefix import prompt_block_hashes
from glm5_worker.kv.block_manager import BlockManager
from glm5_worker.kv.events import CacheEvents

from tests.unit.worker.test_block_manager import Seq, compute


def _prefill(bm: BlockManager, tokens: list[int]) -> Seq:
    seq = Seq(tokens)
    bm.match_prefix(seq)
    compute(bm, seq, len(tokens) - seq.num_computed_tokens)
    return seq


class Index:
    """What a router keeps: the hashes it believes the worker holds, from deltas and snapshots."""

    def __init__(self) -> None:
        self.epoch, self.seq, self.held, self.snapshots = 0, 0, set[bytes](), 0

    def poll(self, bm: BlockManager) -> None:
        d = bm.cache_delta(self.epoch, self.seq)
        assert d.after == self.seq
        if d.snapshot:
            self.held, self.snapshots = set(d.stored), self.snapshots + 1
        else:
            assert not set(d.stored) & set(d.removed)
            self.held = (self.held - set(d.removed)) | set(d.stored)
        self.epoch, self.seq = d.epoch, d.seq


def test_an_index_of_deltas_follows_stores_evictions_a_swap_and_gaps() -> None:
    bm = BlockManager(6, 0, 4, 1 << 30, event_log=8)
    index = Index()
    index.poll(bm)
    assert index.snapshots == 1 and not index.held  # the first ask: epoch 0 is nobody's
    a = _prefill(bm, list(range(13)))  # 3 full blocks
    index.poll(bm)
    assert index.held == set(bm.cached) == set(prompt_block_hashes(a.tokens, 4)) and index.snapshots == 1
    bm.free(a)  # still cached (evictable): nothing changes
    index.poll(bm)
    assert index.held == set(bm.cached) and len(index.held) == 3
    b = _prefill(bm, [100 + i for i in range(17)])  # needs 5 blocks of 6: evicts a's LRU blocks
    index.poll(bm)
    assert index.held == set(bm.cached) and set(b.block_hashes) <= index.held and len(index.held) < 7
    assert index.snapshots == 1
    # a router that fell behind by more than the log keeps gets a snapshot
    stale = Index()
    stale.epoch, stale.seq = index.epoch, 0
    bm.free(b)
    for n in range(3):
        bm.free(_prefill(bm, [1000 * (n + 1) + i for i in range(9)]))
        index.poll(bm)  # in step: deltas only
    assert bm.events.seq > 8 and index.snapshots == 1
    stale.poll(bm)
    assert stale.snapshots == 1 and stale.held == index.held == set(bm.cached)
    # a weight swap drops every cached block: a new epoch, so the router replaces what it has by nothing
    epoch = bm.events.epoch
    bm.drop_prefix_cache([])
    index.poll(bm)
    assert bm.events.epoch != epoch and index.held == set() and index.snapshots == 2


def test_a_delta_is_the_net_change_and_a_restart_is_a_new_epoch() -> None:
    log = CacheEvents(16)
    log.stored(b"a")
    log.stored(b"b")
    log.removed(b"a")
    log.stored(b"c")
    log.removed(b"c")
    log.stored(b"c")
    d = log.since(log.epoch, 1, [b"b", b"c"])
    assert not d.snapshot and sorted(d.stored) == [b"b", b"c"] and d.removed == [b"a"] and d.seq == 6
    assert log.since(log.epoch, 6, []).stored == [] and not log.since(log.epoch, 6, []).snapshot
    assert log.since(log.epoch, 7, [b"b"]).snapshot  # ahead of the log: another epoch's number
    other = CacheEvents(16)  # a restarted worker
    assert other.epoch != log.epoch and other.since(log.epoch, 6, [b"x"]).stored == [b"x"]
