"""Paged storage of the MLA cache: per token and layer, the latent + shared rope key, and the indexer key.

Two tiers share one slot address space. Slots [0, num_fp_slots) hold tokens in the layout's dtype (L1, recent
tokens; the model's unless the worker sets another); slots [num_fp_slots, num_slots) hold tokens as INT8 with
per-token scales (L2, older tokens). A block of `block_size` consecutive slots belongs to one tier; the
worker's block manager decides which blocks a sequence uses and when an L1 block is demoted to L2. Nothing
here knows about sequences.

Quantisation is symmetric per token and per component (latent, rope key, indexer key each get one scale), so
a gathered row dequantises as `int8 * scale` with no zero point.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

INT8_MAX = 127.0


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    index_dim: int
    # index into the indexer-key pool for every layer; -1 for layers that reuse another layer's top-k
    index_slot_of_layer: tuple[int, ...]
    block_size: int
    num_fp_blocks: int
    num_q_blocks: int
    dtype: torch.dtype
    device: torch.device
    # L1 indexer keys (None: `dtype`). A float32 model can keep them in bfloat16: they only rank tokens for the
    # top-k, and scoring reads half the bytes (DeepSeek-V3.2 keeps its indexer keys in FP8)
    index_dtype: torch.dtype | None = None

    @property
    def idx_dtype(self) -> torch.dtype:
        return self.index_dtype or self.dtype

    @property
    def kv_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def num_index_layers(self) -> int:
        return sum(1 for i in self.index_slot_of_layer if i >= 0)

    @property
    def num_fp_slots(self) -> int:
        return self.num_fp_blocks * self.block_size

    @property
    def num_q_slots(self) -> int:
        return self.num_q_blocks * self.block_size

    @property
    def num_blocks(self) -> int:
        return self.num_fp_blocks + self.num_q_blocks

    def fp_bytes_per_token(self) -> int:
        """All layers, L1: latent + rope key (+ indexer key on full-indexer layers)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        idx_elem = torch.tensor([], dtype=self.idx_dtype).element_size()
        return elem * self.num_layers * self.kv_dim + idx_elem * self.num_index_layers * self.index_dim

    def q_bytes_per_token(self) -> int:
        """All layers, INT8 tier: one byte per value plus a float16 scale per component."""
        scales = 2 * (2 * self.num_layers + self.num_index_layers)
        return self.num_layers * self.kv_dim + self.num_index_layers * self.index_dim + scales


def _pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool tensor. Decode and top-k gathers read slots past a sequence's context and mask them
    out, but a masked garbage NaN still poisons the output (0 x NaN in the value product), so a pool must never
    hold garbage. On the CPU an anonymous mapping gives zero pages the OS commits only when first written (so
    a large pool costs memory as it fills, not at start-up), whatever the heap allocator would have recycled;
    accelerators zero their pool once."""
    numel = math.prod(shape)
    if device.type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel).view(shape)


def _take(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool (S, D), slots (...) -> (..., D); index_select is several times faster than fancy indexing."""
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, pool.shape[-1])


def _write(pool: torch.Tensor, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[layer, slots] = rows. A compiled step must mutate the pool tensor itself, not a view of one layer:
    an in-place write into a view of a graph input makes the compiled graph copy the whole pool."""
    if torch.compiler.is_compiling():
        pool.index_put_((torch.full_like(slots, layer), slots), rows.to(pool.dtype))
    else:
        pool[layer].index_copy_(0, slots, rows.to(pool.dtype))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., D) float -> (..., D) int8 and (..., 1) float16 scale, symmetric absmax per row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / INT8_MAX
    scale16 = scale.to(torch.float16)
    # quantise with the scale as stored (float16) so dequantisation inverts exactly what was rounded
    q = torch.round(xf / scale16.float()).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale16


class PagedKVStorage:
    """The tensors of the KV pool and the gathers/scatters the attention kernels use."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        lo = layout
        dev = lo.device
        self.fp_kv = _pool((lo.num_layers, lo.num_fp_slots, lo.kv_dim), lo.dtype, dev)
        self.fp_index = _pool((lo.num_index_layers, lo.num_fp_slots, lo.index_dim), lo.idx_dtype, dev)
        self.q_kv = _pool((lo.num_layers, lo.num_q_slots, lo.kv_dim), torch.int8, dev)
        # scale[..., 0] for the latent, scale[..., 1] for the rope key
        self.q_kv_scale = _pool((lo.num_layers, lo.num_q_slots, 2), torch.float16, dev)
        self.q_index = _pool((lo.num_index_layers, lo.num_q_slots, lo.index_dim), torch.int8, dev)
        self.q_index_scale = _pool((lo.num_index_layers, lo.num_q_slots, 1), torch.float16, dev)

    @property
    def has_q_tier(self) -> bool:
        return self.layout.num_q_blocks > 0

    def nbytes(self) -> int:
        tensors = (self.fp_kv, self.fp_index, self.q_kv, self.q_kv_scale, self.q_index, self.q_index_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

    # writes (new tokens always land in L1) -----------------------------------------------------------------
    def write_kv(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """slots (N,) L1 slot ids; rows (N, kv_dim)."""
        _write(self.fp_kv, layer, slots, rows)

    def write_index(self, index_layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        _write(self.fp_index, index_layer, slots, keys)

    # reads
    def gather_kv(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """slots (...) of either tier -> rows (..., kv_dim) in `dtype`. Invalid slots must be clamped to 0."""
        fp = self.fp_kv[layer]
        if not self.has_q_tier:
            return _take(fp, slots).to(dtype)
        c = self.layout.kv_lora_rank

        def dequantise(qslots: torch.Tensor) -> torch.Tensor:
            q = self.q_kv[layer].index_select(0, qslots).to(dtype)
            scale = self.q_kv_scale[layer].index_select(0, qslots).to(dtype)
            q[:, :c] *= scale[:, :1]
            q[:, c:] *= scale[:, 1:]
            return q

        return self._gather_tiered(fp, slots, dtype, dequantise)

    def gather_index(self, index_layer: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """slots (...) of either tier -> indexer keys (..., index_dim) in `dtype`."""
        fp = self.fp_index[index_layer]
        if not self.has_q_tier:
            return _take(fp, slots).to(dtype)

        def dequantise(qslots: torch.Tensor) -> torch.Tensor:
            q = self.q_index[index_layer].index_select(0, qslots).to(dtype)
            return q.mul_(self.q_index_scale[index_layer].index_select(0, qslots).to(dtype))

        return self._gather_tiered(fp, slots, dtype, dequantise)

    def _gather_tiered(
        self,
        fp: torch.Tensor,
        slots: torch.Tensor,
        dtype: torch.dtype,
        dequantise: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Reads each slot from its own tier once (no read of both tiers per slot, no select afterwards)."""
        flat = slots.reshape(-1)
        n_fp = self.layout.num_fp_slots
        is_q = flat >= n_fp
        if torch.compiler.is_compiling():
            # A compiled step cannot split the slots by tier (data-dependent sizes break the graph, and the
            # pieces would compile anew for every split seen while serving): both tiers are read at clamped
            # slots and one kept, in one fused loop.
            q = dequantise((flat - n_fp).clamp(min=0))
            own = fp.index_select(0, flat.clamp(max=max(n_fp - 1, 0))).to(dtype)
            return torch.where(is_q.unsqueeze(1), q, own).view(*slots.shape, fp.shape[-1])
        out = torch.empty(flat.shape[0], fp.shape[-1], dtype=dtype, device=fp.device)
        q_pos = is_q.nonzero().squeeze(1)
        fp_pos = (~is_q).nonzero().squeeze(1)
        if fp_pos.numel():
            out[fp_pos] = fp.index_select(0, flat[fp_pos]).to(dtype)
        if q_pos.numel():
            out[q_pos] = dequantise(flat[q_pos] - n_fp)
        return out.view(*slots.shape, fp.shape[-1])

    def index_run(self, index_layer: int, first_block: int, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """In-place view of `length` indexer keys starting at unified block `first_block` (one tier only):
        (keys (length, Di), None) in L1, (int8 keys, scales (length, 1)) in L2."""
        bs, n_fp = self.layout.block_size, self.layout.num_fp_blocks
        if first_block < n_fp:
            start = first_block * bs
            return self.fp_index[index_layer, start : start + length], None
        start = (first_block - n_fp) * bs
        end = start + length
        return self.q_index[index_layer, start:end], self.q_index_scale[index_layer, start:end]

    def runs(self, table: list[int], length: int) -> list[tuple[int, int]]:
        """Splits a block table covering `length` tokens into (first block, tokens) runs of consecutive
        block ids within one tier, so each run can be read as one in-place view."""
        bs, n_fp = self.layout.block_size, self.layout.num_fp_blocks
        n = -(-length // bs)
        ids = np.asarray(table[:n], dtype=np.int64)
        breaks = np.flatnonzero((np.diff(ids) != 1) | (ids[1:] == n_fp)) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [n]))
        return [(int(ids[s]), min(int(e) * bs, length) - int(s) * bs) for s, e in zip(starts, ends, strict=True)]

    # tiering
    def demote(self, fp_blocks: torch.Tensor, q_blocks: torch.Tensor) -> None:
        """Quantises L1 blocks into L2 blocks (all layers). Block ids are tier-local (0-based per tier)."""
        bs = self.layout.block_size
        offs = torch.arange(bs, device=fp_blocks.device)
        src = (fp_blocks[:, None] * bs + offs).reshape(-1)
        dst = (q_blocks[:, None] * bs + offs).reshape(-1)
        c = self.layout.kv_lora_rank
        rows = self.fp_kv[:, src]  # (L, n, kv_dim)
        q_lat, s_lat = quantize_rows(rows[..., :c])
        q_rope, s_rope = quantize_rows(rows[..., c:])
        self.q_kv[:, dst] = torch.cat([q_lat, q_rope], dim=-1)
        self.q_kv_scale[:, dst] = torch.cat([s_lat, s_rope], dim=-1)
        if self.layout.num_index_layers:
            q_idx, s_idx = quantize_rows(self.fp_index[:, src])
            self.q_index[:, dst] = q_idx
            self.q_index_scale[:, dst] = s_idx
