"""Allocation of KV blocks to sequences: two tiers, prefix reuse, demotion, usage and fragmentation.

Block ids are unified: [0, num_fp) are L1 blocks (model precision), [num_fp, num_fp + num_q) are L2 blocks
(INT8). A sequence's block table is always some L2 blocks followed by L1 blocks: new tokens land in L1, and
a block is demoted to L2 once all its tokens are more than `l1_tokens` behind the newest token.

Prefix reuse (vLLM-style): every full block gets a chain hash of all tokens up to its end; a new sequence
reuses the longest run of cached blocks that matches its prompt. A block nobody references stays cached
(evictable, LRU) until its memory is needed. A cached L2 block is reused only where it would be L2 for the
new sequence too, so prefix reuse never changes which tokens a sequence sees at full precision. Every hash the
cache starts or stops holding is logged (kv.events) for the routers that route by cached prefix.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from glm5.kvcache.prefix import block_hash

from glm5_worker.kv.events import DEFAULT_LOG_EVENTS, CacheDelta, CacheEvents


class SequenceBlocks(Protocol):
    """What the block manager needs from a sequence."""

    block_table: list[int]
    block_hashes: list[bytes]
    num_registered_blocks: int
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class KVStats:
    total_blocks: int
    free_blocks: int
    usage: float
    fragmentation: float
    prefix_hit_rate: float


class BlockManager:
    def __init__(
        self,
        num_fp_blocks: int,
        num_q_blocks: int,
        block_size: int,
        l1_tokens: int,
        prefix_caching: bool = True,
        event_log: int = DEFAULT_LOG_EVENTS,
    ) -> None:
        if num_fp_blocks <= 0:
            raise ValueError("the KV pool needs at least one full-precision block")
        self.num_fp, self.num_q, self.block_size = num_fp_blocks, num_q_blocks, block_size
        self.l1_tokens = l1_tokens
        self.prefix_caching = prefix_caching
        total = num_fp_blocks + num_q_blocks
        self.ref = [0] * total
        self.hash_of: list[bytes | None] = [None] * total
        self.cached: dict[bytes, int] = {}
        self._free: tuple[list[int], list[int]] = (list(range(num_fp_blocks)), list(range(num_fp_blocks, total)))
        # heaps: allocating the lowest free id keeps used blocks packed (less fragmentation)
        self._evictable: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (OrderedDict(), OrderedDict())
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.events = CacheEvents(event_log)

    @property
    def total_blocks(self) -> int:
        return self.num_fp + self.num_q

    def is_q(self, block: int) -> bool:
        return block >= self.num_fp

    def num_free(self, q_tier: bool = False) -> int:
        t = int(q_tier)
        return len(self._free[t]) + len(self._evictable[t])

    # allocation ---------------------------------------------------------------------------------------------
    def _alloc(self, q_tier: bool) -> int | None:
        t = int(q_tier)
        if self._free[t]:
            b = heapq.heappop(self._free[t])
        elif self._evictable[t]:
            b, _ = self._evictable[t].popitem(last=False)
            h = self.hash_of[b]
            if h is not None and self.cached.get(h) == b:
                del self.cached[h]
                self.events.removed(h)
            self.hash_of[b] = None
        else:
            return None
        self.ref[b] = 1
        return b

    def _take(self, b: int) -> None:
        if self.ref[b] == 0:
            self._evictable[int(self.is_q(b))].pop(b, None)
        self.ref[b] += 1

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0, f"block {b} released twice"
        if self.ref[b]:
            return
        h = self.hash_of[b]
        if h is not None and self.cached.get(h) == b:
            self._evictable[int(self.is_q(b))][b] = None
        else:
            self.hash_of[b] = None
            heapq.heappush(self._free[int(self.is_q(b))], b)

    def reserve(self) -> int:
        """An L1 block out of circulation until release(): scratch space no sequence reads or writes meanwhile
        (the decode-step compiler's dummy tokens)."""
        b = self._alloc(q_tier=False)
        if b is None:
            raise ValueError("no free L1 block to reserve")
        return b

    def release(self, block: int) -> None:
        """Puts a block reserve() gave back into circulation."""
        self._release(block)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure_slots(self, seq: SequenceBlocks, num_new_tokens: int) -> bool:
        """Gives the sequence L1 blocks for `num_new_tokens` more tokens; False (and no change) if full."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free(q_tier=False):
            return False
        for _ in range(need):
            b = self._alloc(q_tier=False)
            assert b is not None
            seq.block_table.append(b)
        return True

    def free(self, seq: SequenceBlocks) -> None:
        # tail first: the LRU then evicts a sequence's last blocks before its (more shareable) prefix
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def slot(self, seq: SequenceBlocks, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # prefix reuse -------------------------------------------------------------------------------------------
    def _hash_blocks(self, seq: SequenceBlocks, upto_blocks: int) -> None:
        tokens = seq.all_token_ids
        bs = self.block_size
        for j in range(len(seq.block_hashes), upto_blocks):
            parent = seq.block_hashes[j - 1] if j else b""
            seq.block_hashes.append(block_hash(parent, tokens[j * bs : (j + 1) * bs]))

    def match_prefix(self, seq: SequenceBlocks) -> int:
        """Attaches cached blocks matching the start of a new sequence; returns the tokens they hold."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.prefix_caching:
            return 0
        n_tokens = len(seq.all_token_ids)
        # at least one token must be computed to produce logits for the next one
        n_full = (n_tokens - 1) // self.block_size
        self._hash_blocks(seq, n_full)
        self.prefix_queries += n_tokens
        seen_l1 = False
        for j in range(n_full):
            b = self.cached.get(seq.block_hashes[j])
            if b is None:
                break
            if self.is_q(b):
                if seen_l1 or (j + 1) * self.block_size > n_tokens - self.l1_tokens:
                    break
            else:
                seen_l1 = True
            self._take(b)
            seq.block_table.append(b)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_registered_blocks = len(seq.block_table)
        self.prefix_hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    def unmatch(self, seq: SequenceBlocks, matched: int | None) -> None:
        """Undoes match_prefix (which found `matched` tokens; None: it was not asked) for a sequence that could not
        be admitted after all: its blocks go back (they stay cached) and the query leaves the hit-rate
        statistics."""
        if self.prefix_caching and matched is not None:
            self.prefix_queries -= len(seq.all_token_ids)
            self.prefix_hits -= matched
        self.free(seq)

    def drop_prefix_cache(self, running: list[SequenceBlocks]) -> None:
        """New weights: KV computed with the old ones must never be reused by a later prompt. Cached blocks
        nobody uses go back to the free lists; running sequences keep theirs but stop registering them."""
        for t in (0, 1):
            for b in self._evictable[t]:
                heapq.heappush(self._free[t], b)
            self._evictable[t].clear()
        self.cached.clear()
        self.events.restart()
        self.hash_of = [None] * self.total_blocks
        for seq in running:
            seq.num_registered_blocks = 1 << 62  # their later blocks mix old and new weights

    def register_full_blocks(self, seq: SequenceBlocks) -> None:
        """Makes the sequence's newly completed blocks findable by later prompts."""
        if not self.prefix_caching:
            return
        n_full = seq.num_computed_tokens // self.block_size
        self._hash_blocks(seq, n_full)
        for j in range(seq.num_registered_blocks, n_full):
            h, b = seq.block_hashes[j], seq.block_table[j]
            if h not in self.cached:
                self.cached[h] = b
                self.hash_of[b] = h
                self.events.stored(h)
        seq.num_registered_blocks = max(seq.num_registered_blocks, n_full)

    def cache_delta(self, epoch: int, after: int) -> CacheDelta:
        """The prefix cache's events since (epoch, after), or a snapshot of every hash it holds (kv.events)."""
        return self.events.since(epoch, after, self.cached.keys())

    # tiering ------------------------------------------------------------------------------------------------
    def demote(self, seq: SequenceBlocks) -> list[tuple[int, int]]:
        """Moves the sequence's L1 blocks that left the L1 window to L2.

        Returns (L1 block, L2 block) pairs, tier-local ids, whose contents the caller must quantise now,
        before the next allocation can hand the L1 block to someone else.
        """
        if not self.num_q:
            return []
        bs = self.block_size
        limit = (seq.num_computed_tokens - self.l1_tokens) // bs  # blocks [0, limit) are out of the window
        copies: list[tuple[int, int]] = []
        for j in range(limit):
            b = seq.block_table[j]
            if self.is_q(b):
                continue
            h = seq.block_hashes[j] if j < len(seq.block_hashes) else None
            existing = self.cached.get(h) if h is not None else None
            if existing is not None and self.is_q(existing):
                self._take(existing)
                seq.block_table[j] = existing
            else:
                q = self._alloc(q_tier=True)
                if q is None:
                    break  # L2 full: keep the rest at full precision for now
                copies.append((b, q - self.num_fp))
                seq.block_table[j] = q
                if h is not None:
                    if h not in self.cached:
                        self.events.stored(h)
                    self.cached[h] = q
                    self.hash_of[q] = h
            self._release(b)
        return copies

    # metrics -----------------------------------------------------------------------------------------------
    def stats(self) -> KVStats:
        free_ids = sorted([*self._free[0], *self._free[1], *self._evictable[0], *self._evictable[1]])
        free = len(free_ids)
        largest = run = 0
        for i, b in enumerate(free_ids):
            run = run + 1 if i and b == free_ids[i - 1] + 1 else 1
            largest = max(largest, run)
        return KVStats(
            total_blocks=self.total_blocks,
            free_blocks=free,
            usage=1.0 - free / self.total_blocks,
            fragmentation=(1.0 - largest / free) if free else 0.0,
            prefix_hit_rate=self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
        )
