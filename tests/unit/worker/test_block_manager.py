from __future__ import annotations

from dataclasses import dataclass, field

from glm5_worker.kv.block_manager import BlockManager


@dataclass
class Seq:
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens


def compute(bm: BlockManager, seq: Seq, n: int) -> None:
    assert bm.ensure_slots(seq, n)
    seq.num_computed_tokens += n
    bm.register_full_blocks(seq)


def test_prefix_reuse_shares_full_blocks_and_keeps_one_token_to_compute() -> None:
    bm = BlockManager(16, 0, 4, l1_tokens=0)
    a = Seq(list(range(10)))
    assert bm.match_prefix(a) == 0
    compute(bm, a, 10)
    b = Seq(list(range(10)) + [99])
    assert bm.match_prefix(b) == 8  # two full blocks
    assert b.block_table == a.block_table[:2]
    assert bm.ref[a.block_table[0]] == 2
    c = Seq(list(range(8)))  # exactly two blocks: the last one is recomputed
    assert bm.match_prefix(c) == 4
    d = Seq([1] + list(range(1, 10)))
    assert bm.match_prefix(d) == 0


def test_freed_blocks_stay_cached_until_evicted() -> None:
    bm = BlockManager(4, 0, 4, l1_tokens=0)
    a = Seq(list(range(8)))
    compute(bm, a, 8)
    first = list(a.block_table)
    bm.free(a)
    assert bm.num_free() == 4 and bm.stats().usage == 0.0
    b = Seq(list(range(8)) + [1])
    assert bm.match_prefix(b) == 8 and b.block_table == first
    bm.free(b)
    # fill the pool with other data: the cached blocks get evicted
    c = Seq(list(range(100, 116)))
    compute(bm, c, 16)
    e = Seq(list(range(8)) + [1])
    assert bm.match_prefix(e) == 0


def test_allocation_fails_without_side_effects_when_full() -> None:
    bm = BlockManager(3, 0, 4, l1_tokens=0)
    a = Seq(list(range(8)))
    compute(bm, a, 8)
    b = Seq(list(range(50, 60)))
    assert not bm.ensure_slots(b, 10)
    assert b.block_table == [] and bm.num_free() == 1


def test_demotion_moves_old_blocks_to_l2_in_order() -> None:
    bm = BlockManager(4, 8, 4, l1_tokens=4)
    a = Seq(list(range(12)))
    compute(bm, a, 12)
    copies = bm.demote(a)
    # tokens 0..7 are more than 4 behind the newest: blocks 0 and 1 move, block 2 stays
    assert [fp for fp, _ in copies] == [0, 1]
    assert [bm.is_q(b) for b in a.block_table] == [True, True, False]
    assert bm.num_free(q_tier=False) == 3
    # a new sequence with the same prefix reuses the L2 block only where it is outside its own L1 window
    b = Seq(list(range(12)) + [7])
    assert bm.match_prefix(b) == 12  # L2, L2, then a's L1 block
    assert [bm.is_q(x) for x in b.block_table] == [True, True, False]
    short = Seq(list(range(8)) + [7])
    assert bm.match_prefix(short) == 4  # block 1 would be inside short's L1 window


def test_demotion_reuses_an_existing_l2_copy() -> None:
    bm = BlockManager(8, 8, 4, l1_tokens=4)
    a, b = Seq(list(range(12))), Seq(list(range(12)))
    compute(bm, a, 12)
    assert bm.match_prefix(b) == 8  # shares a's L1 blocks 0 and 1
    compute(bm, b, 4)
    first = bm.demote(a)
    second = bm.demote(b)
    assert len(first) == 2 and second == []  # b points at a's L2 copies, no second quantisation
    assert a.block_table[:2] == b.block_table[:2]


def test_fragmentation_is_share_of_free_blocks_outside_the_largest_run() -> None:
    bm = BlockManager(8, 0, 1, l1_tokens=0, prefix_caching=False)
    seqs = [Seq([i]) for i in range(8)]
    for s in seqs:
        compute(bm, s, 1)
    for i in (1, 3, 4, 6):
        bm.free(seqs[i])
    st = bm.stats()
    assert st.free_blocks == 4 and st.usage == 0.5
    assert st.fragmentation == 0.5  # runs {1}, {3,4}, {6}: largest 2 of 4


def test_unmatch_gives_the_blocks_back_and_leaves_the_statistics_as_they_were() -> None:
    bm = BlockManager(16, 0, 4, l1_tokens=0)
    a = Seq(list(range(10)))
    bm.match_prefix(a)
    compute(bm, a, 10)
    bm.free(a)  # its two full blocks stay cached
    queries, hits = bm.prefix_queries, bm.prefix_hits
    b = Seq(list(range(10)))
    matched = bm.match_prefix(b)
    assert matched == 8 and bm.prefix_hits == hits + 8
    bm.unmatch(b, matched)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (queries, hits)
    assert bm.num_free() == 16  # nothing referenced: the cached blocks are free to evict
    assert bm.match_prefix(Seq(list(range(10)))) == 8  # and still cached
