"""Multi-latent attention with DeepSeek sparse attention (DSA), over the paged latent cache.

Per layer: project queries and the latent, write the new tokens' latent + rope key (and indexer key) to
the cache, pick each query's tokens (lightning indexer + top-k on "full" layers, the previous full layer's
choice on "shared" layers), then attend over the picked tokens only, in absorbed form:
scores = (q_nope W_uk) . c + q_rope . k_rope, output = (P c) W_uv. References: DeepSeek-V2 (MLA),
DeepSeek-V3.2 (DSA), transformers' modeling_glm_moe_dsa.py (5.23.0) for the exact layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from glm5.kernels.base import DSAKernels
from glm5.kvcache.storage import PagedKVStorage
from glm5.model.batch import DecodeGroup, ForwardBatch
from glm5.model.config import ModelConfig
from glm5.model.fused import Fused, fuse_rows, run_fused
from glm5.model.norms import RMSNorm
from glm5.model.quant import dense_weight
from glm5.model.rope import apply_interleaved
from glm5.parallel import SINGLE, TensorParallel

compiling = torch.compiler.is_compiling

# Bound on the elements of one temporary (index scores, attention scores, gathered rows). Besides bounding
# memory on long prefills, it keeps temporaries (<= 8 MiB in float32) below glibc's mmap threshold: larger
# ones are mapped fresh and page-faulted on every call, which made such steps several times slower.
SCRATCH_ELEMENTS = 1 << 21
# Queries per dense-attention call in a prefill chunk: smaller tiles leave out more of the causally masked
# context (a 1024-token chunk in tiles of 128 computes ~56% of its full score matrix).
SHARED_TILE_ROWS = 128
# Elements of one tile of prefill index scores (queries x indexer heads x context): the product and the relu and
# weighted sum that reread it run faster on a tile that stays in cache (a 1K-token chunk, 8 heads: 6.2 ms in
# 131-row tiles vs 10.4 ms in 262-row ones).
INDEX_TILE_ELEMENTS = 1 << 20


@dataclass(slots=True)
class Picked:
    """The tokens a group of queries attends to. `shared`: one context for all queries (dense path); its n
    queries are then the context's last n positions (a prefill chunk), so query i sees at most T - n + i + 1."""

    slots: torch.Tensor  # (n, k) per query, or (T,) when shared
    valid: torch.Tensor  # (n, k) or (n, T)
    shared: bool


@dataclass(slots=True)
class LayerSelection:
    decode: Picked | None
    prefills: list[Picked]


@dataclass(slots=True)
class DSAControls:
    """Runtime DSA settings of the engine (not of the checkpoint)."""

    # queries at positions below this attend densely; exact whenever it is <= index_topk
    dense_warmup_tokens: int = 128
    # decode contexts at least this long score indexer keys in place, run by run, instead of gathering them
    paged_scoring_min_tokens: int = 8192
    # prefill chunks whose context is at most this many times top-k attend through a mask over the context
    # (in the absorbed form; the expanded form widens it by MLAttention.expanded_mask_gain)
    prefill_dense_ratio: float = 4.0


class Indexer(nn.Module):
    """DSA lightning indexer: its own small query/key projections and per-head weights."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # kept in float32 whatever the model dtype, as in the reference (_keep_in_fp32_modules)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.softmax_scale = self.head_dim**-0.5

    def project(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_raw: torch.Tensor | None = None,
        k_raw: torch.Tensor | None = None,
        w_raw: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D), q_resid (N, q_lora) -> q (N, Hi, Di) f32, k (N, Di), weights (N, Hi) f32. `q_raw`, `k_raw`,
        `w_raw`: wq_b(q_resid), wk(x), weights_proj(x) when the attention computed them in a fused product."""
        n = x.shape[0]
        q = (self.wq_b(q_resid) if q_raw is None else q_raw).view(n, self.num_heads, self.head_dim)
        # rope on the first rope_dim dims here (MLA puts it last)
        q = torch.cat([apply_interleaved(q[..., : self.rope_dim], cos, sin), q[..., self.rope_dim :]], dim=-1)
        k = self.k_norm(self.wk(x) if k_raw is None else k_raw)
        k = torch.cat([apply_interleaved(k[..., : self.rope_dim], cos, sin), k[..., self.rope_dim :]], dim=-1)
        if w_raw is None:
            # float32 like the reference; a quantized weights_proj dequantizes to the input's dtype, so float32
            wp = self.weights_proj
            w_raw = wp(x.to(wp.weight.dtype if isinstance(wp, nn.Linear) else torch.float32))
        return q.float(), k, w_raw.float() * self.num_heads**-0.5


class MLAttention(nn.Module):
    """Under tensor parallelism a rank runs heads [rank * H/N, (rank + 1) * H/N) over the full latent cache and
    returns its partial o_proj output (the caller all-reduces it); the indexer is replicated."""

    def __init__(self, config: ModelConfig, layer_idx: int, index_layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.index_layer = index_layer  # row in the indexer-key pool; -1 on shared layers
        self.num_heads = config.num_attention_heads // tp.size  # this rank's heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.index_topk = config.index_topk
        self.scale = config.softmax_scale
        bias = config.attention_bias
        h = config.hidden_size
        self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, config.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.indexer = Indexer(config) if index_layer >= 0 else None
        self._fused: Fused | None = None  # fuse_input_projections()
        self._fused_q: Fused | None = None

    def fuse_input_projections(self) -> int:
        """q_a, kv_a and the indexer's wk and weights_proj as one product, q_b and the indexer's wq_b as another
        (glm5.model.fused: 6 -> 2 on a full-indexer layer, as far as they qualify); returns how many were fused."""
        parts: list[nn.Module] = [self.q_a_proj, self.kv_a_proj_with_mqa]
        if self.indexer is not None:
            parts += [self.indexer.wk, self.indexer.weights_proj]
        if self._fused is not None:
            return 0
        self._fused = fuse_rows(parts)
        # and the two products of q_resid: MLA's q_b and the indexer's wq_b
        self._fused_q = fuse_rows([self.q_b_proj, self.indexer.wq_b]) if self.indexer is not None else None
        return (len(self._fused[1]) if self._fused else 0) + (len(self._fused_q[1]) if self._fused_q else 0)

    def _w_kv_b(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj's weight per head (absorbed attention multiplies by it directly): (H, nope + v, C)."""
        w = dense_weight(self.kv_b_proj, dtype)
        return w.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVStorage,
        kernels: DSAKernels,
        controls: DSAControls,
        prev: LayerSelection | None,
    ) -> tuple[torch.Tensor, LayerSelection]:
        n = x.shape[0]
        # the fused products (fuse_input_projections) give what the indexer would compute itself as well
        k_raw = w_raw = q_raw = None
        if self._fused is not None:
            q_a, kv_a, *rest = run_fused(x, self._fused)
            k_raw, w_raw = (*rest, None, None)[:2]
        else:
            q_a, kv_a = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        q_resid = self.q_a_layernorm(q_a)
        if self._fused_q is not None:
            q_b, q_raw = run_fused(q_resid, self._fused_q)
        else:
            q_b = self.q_b_proj(q_resid)
        q = q_b.view(n, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_interleaved(q_rope, cos, sin)  # (N, H, R)
        latent, k_rope = torch.split(kv_a, [self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rope = apply_interleaved(k_rope, cos, sin)
        cache.write_kv(self.layer_idx, batch.slot_mapping, torch.cat([latent, k_rope], dim=-1))

        index: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.indexer is not None:
            iq, ik, iw = self.indexer.project(x, q_resid, cos, sin, q_raw, k_raw, w_raw)
            cache.write_index(self.index_layer, batch.slot_mapping, ik)
            index = (iq, iw)
        elif prev is None:
            raise ValueError(f"layer {self.layer_idx} shares top-k but no full indexer layer precedes it")

        w_kv_b = self._w_kv_b(q_nope.dtype)
        topk = batch.layer_topk[self.layer_idx] if batch.layer_topk else self.index_topk
        selector = _Selector(self, cache, kernels, controls, topk, index, batch)
        entropies: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []  # (rows, H, V) per group, in row order: decode rows, then each chunk

        decode_pick: Picked | None = None
        if batch.decode is not None:
            d = batch.decode.num_seqs
            decode_pick = prev.decode if prev is not None and index is None else selector.decode()
            assert decode_pick is not None
            parts.append(self._absorbed(decode_pick, q_nope[:d], q_rope[:d], w_kv_b, cache, kernels, batch, entropies))
        prefill_picks: list[Picked] = []
        for i, chunk in enumerate(batch.prefills):
            pick = prev.prefills[i] if prev is not None and index is None else selector.prefill(i)
            prefill_picks.append(pick)
            rows = slice(chunk.start, chunk.start + chunk.length)
            expanded = pick.shared and self.expanded_pays(chunk.length, pick.valid.shape[1])
            attend = self._expanded if expanded else self._absorbed
            parts.append(attend(pick, q_nope[rows], q_rope[rows], w_kv_b, cache, kernels, batch, entropies))
        if entropies:
            batch.entropy[self.layer_idx] = torch.stack(entropies).mean()

        out = parts[0] if len(parts) == 1 else torch.cat(parts)  # (N, H, V)
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim)), LayerSelection(decode_pick, prefill_picks)

    def expanded_pays(self, n: int, t: int) -> bool:
        """Whether n queries over a shared context of t tokens cost fewer multiply-adds in the expanded form
        (_expanded) than in the absorbed one (_absorbed), per head: expanding costs T * C * (nope + v) once, then
        each query-key pair costs nope + R + v instead of 2C + R, and the absorbed form's per-query products
        with W_uk and W_uv (C * (nope + v)) go away. Prefill chunks of more than a few dozen tokens pay (GLM-5's
        shapes: ~300 at a 1K context); single tokens and short chunks over long contexts do not."""
        c, nope, v, r = self.kv_lora_rank, self.nope_dim, self.v_dim, self.rope_dim
        expanded = t * c * (nope + v) + n * t * (nope + r + v)
        absorbed = n * t * (2 * c + r) + n * c * (nope + v)
        return expanded < absorbed

    def expanded_mask_gain(self) -> float:
        """How much wider a context the mask path may cover in the expanded form than in the absorbed one: a
        query-key pair costs nope + R + v multiply-adds there instead of 2C + R; the mask and softmax passes,
        which cost the same per pair in both forms, take about half of that gain (tiny-dsa64, 2K-6K-token
        prompts: the mask path up to 16x top-k was the fastest, against 4x in the absorbed form)."""
        pair = self.nope_dim + self.rope_dim + self.v_dim
        return max(1.0, (2 * self.kv_lora_rank + self.rope_dim) / pair / 2)

    def _absorbed(
        self,
        pick: Picked,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        w_kv_b: torch.Tensor,
        cache: PagedKVStorage,
        kernels: DSAKernels,
        batch: ForwardBatch,
        entropies: list[torch.Tensor],
    ) -> torch.Tensor:
        """Attention in the absorbed form (queries moved into the latent space, the cache read as it is):
        (n, H, nope), (n, H, R) -> (n, H, V)."""
        q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_kv_b[:, : self.nope_dim])  # (n, H, C)
        out_lat = self._attend(pick, q_lat, q_rope, cache, kernels, batch, entropies)
        return torch.einsum("nhc,hvc->nhv", out_lat, w_kv_b[:, self.nope_dim :])

    def _expanded(
        self,
        pick: Picked,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        w_kv_b: torch.Tensor,
        cache: PagedKVStorage,
        kernels: DSAKernels,
        batch: ForwardBatch,
        entropies: list[torch.Tensor],
    ) -> torch.Tensor:
        """Attention over a shared context in the expanded form: the context's latents are multiplied out to
        per-head keys and values once (kv_b_proj), then it is ordinary attention with head dims nope + R and V
        (what vLLM's MLA backends do for prefill; the absorbed form is the decode one). (n, H, nope), (n, H, R)
        -> (n, H, V). Heads go in groups whose keys and values fit the scratch bound."""
        kv = cache.gather_kv(self.layer_idx, pick.slots, q_nope.dtype)  # (T, C + R)
        n, t = pick.valid.shape
        heads, c, nope = self.num_heads, self.kv_lora_rank, self.nope_dim
        latent, k_rope = kv[:, :c], kv[:, None, c:]
        q = torch.cat([q_nope, q_rope], dim=-1)  # (n, H, nope + R)
        group = max(1, min(heads, SCRATCH_ELEMENTS // max(1, t * (nope + self.rope_dim + self.v_dim))))
        tile = max(1, min(SHARED_TILE_ROWS, SCRATCH_ELEMENTS // (group * t)))
        want = batch.collect_entropy
        out = q.new_empty(n, heads, self.v_dim)
        for h0 in range(0, heads, group):
            h1 = min(heads, h0 + group)
            up = (latent @ w_kv_b[h0:h1].reshape(-1, c).T).view(t, h1 - h0, -1)  # (T, g, nope + V)
            k = torch.cat([up[..., :nope], k_rope.expand(t, h1 - h0, self.rope_dim)], dim=-1)
            v = up[..., nope:]
            for s in range(0, n, tile):
                e = min(n, s + tile)
                cut = t - n + e  # causal: nothing past the tile's last row is visible to any of its rows
                res = kernels.dense_mha(q[s:e, h0:h1], k[:cut], v[:cut], pick.valid[s:e, :cut], self.scale, want)
                out[s:e, h0:h1] = res.out
                if res.entropy is not None:
                    entropies.append(res.entropy)
        return out

    def _attend(
        self,
        pick: Picked,
        q_lat: torch.Tensor,
        q_rope: torch.Tensor,
        cache: PagedKVStorage,
        kernels: DSAKernels,
        batch: ForwardBatch,
        entropies: list[torch.Tensor],
    ) -> torch.Tensor:
        """Absorbed-form attention of the n queries over their picks: (n, H, C) latent output."""
        want = batch.collect_entropy
        n = q_lat.shape[0]
        if pick.shared:
            kv = cache.gather_kv(self.layer_idx, pick.slots, q_lat.dtype)  # (T, C + R)
            t = pick.valid.shape[1]
            out = q_lat.new_empty(n, self.num_heads, self.kv_lora_rank)
            tile = max(1, min(SHARED_TILE_ROWS, SCRATCH_ELEMENTS // (self.num_heads * t)))
            for s in range(0, n, tile):
                e = min(n, s + tile)
                cut = t - n + e  # causal: nothing past the tile's last row is visible to any of its rows
                res = kernels.dense_mla(q_lat[s:e], q_rope[s:e], kv[:cut], pick.valid[s:e, :cut], self.scale, want)
                out[s:e] = res.out
                if res.entropy is not None:
                    entropies.append(res.entropy)
            return out
        k = pick.slots.shape[1]
        if compiling():
            # a compiled step takes its (bounded) batch in one piece: a loop would fix the batch size in its graph
            kv = cache.gather_kv(self.layer_idx, pick.slots, q_lat.dtype)
            res = kernels.sparse_mla(q_lat, q_rope, kv, pick.valid, self.scale, want)
            if res.entropy is not None:
                entropies.append(res.entropy)
            return res.out
        out = q_lat.new_empty(n, self.num_heads, self.kv_lora_rank)
        tile = max(1, SCRATCH_ELEMENTS // max(1, k * cache.layout.kv_dim))
        for s in range(0, n, tile):
            e = min(n, s + tile)
            kv = cache.gather_kv(self.layer_idx, pick.slots[s:e], q_lat.dtype)  # (t, k, C + R)
            res = kernels.sparse_mla(q_lat[s:e], q_rope[s:e], kv, pick.valid[s:e], self.scale, want)
            out[s:e] = res.out
            if res.entropy is not None:
                entropies.append(res.entropy)
        return out


class _Selector:
    """Picks each query's context tokens on a full-indexer layer."""

    def __init__(
        self,
        attn: MLAttention,
        cache: PagedKVStorage,
        kernels: DSAKernels,
        controls: DSAControls,
        topk: int,
        index: tuple[torch.Tensor, torch.Tensor] | None,
        batch: ForwardBatch,
    ) -> None:
        self.attn, self.cache, self.kernels, self.topk = attn, cache, kernels, topk
        self.warmup = controls.dense_warmup_tokens
        self.paged_min = controls.paged_scoring_min_tokens
        self.dense_ratio = controls.prefill_dense_ratio
        self.index, self.batch = index, batch
        self.block_size = cache.layout.block_size

    def _slots(self, tables: torch.Tensor, length: int) -> torch.Tensor:
        """Block tables (..., nb) -> slots of positions [0, length): (..., length)."""
        pos = torch.arange(length, device=tables.device)
        return tables[..., pos // self.block_size] * self.block_size + pos % self.block_size

    def _scores(self, iq: torch.Tensor, iw: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        assert self.attn.indexer is not None
        return self.kernels.index_scores(iq, iw, keys, self.attn.indexer.softmax_scale)

    def _top(
        self, scores: torch.Tensor, in_warmup: torch.Tensor, width: int, any_warmup: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k per row; rows in the dense warm-up window take every valid token instead."""
        if any_warmup:
            scores = torch.where(in_warmup[:, None] & (scores > float("-inf")), float("inf"), scores)
        # (a compiled step gets here only with more context than top-k: its graph needs kk as a plain int)
        kk = max(self.topk, width) if compiling() else min(scores.shape[-1], max(self.topk, width))
        # order matters only when rows past the top-k must be told apart (warm-up wider than top-k)
        idx, valid = self.kernels.topk(scores, kk, ordered=kk > self.topk)
        if kk > self.topk:
            valid[:, self.topk :] &= in_warmup[:, None]
        return idx, valid

    def decode(self) -> Picked:
        dg = self.batch.decode
        assert dg is not None
        d, t = dg.num_seqs, dg.max_context
        iq, iw = self.index if self.index is not None else (None, None)
        if t >= self.paged_min and t > self.topk and iq is not None and iw is not None and dg.tables is not None:
            assert dg.lengths is not None
            # long contexts: score keys in place and map only the picked positions to slots
            scores = self._paged_scores(iq[:d], iw[:d], dg.tables, dg.lengths, t)
            width = self._warmup_width(dg)
            idx, valid = self._top(scores, dg.context_lens - 1 < self.warmup, width, width > 0)
            bs = self.block_size
            return Picked(dg.block_tables.gather(1, idx // bs) * bs + idx % bs, valid, shared=False)
        slots = self._slots(dg.block_tables, t)  # (D, T)
        in_ctx = torch.arange(t, device=slots.device)[None] < dg.context_lens[:, None]
        if t <= self.topk or iq is None or iw is None:
            # every context token is picked: no need to score them
            return Picked(slots, in_ctx, shared=False)
        keys = self.cache.gather_index(self.attn.index_layer, slots, torch.float32)  # (D, T, Di)
        scores = self._scores(iq[:d, None], iw[:d, None], keys)[:, 0]  # (D, T)
        scores = scores.masked_fill(~in_ctx, float("-inf"))
        width = self._warmup_width(dg)
        idx, valid = self._top(scores, dg.context_lens - 1 < self.warmup, width, width > 0 or compiling())
        return Picked(slots.gather(1, idx), valid, shared=False)

    def _warmup_width(self, dg: DecodeGroup) -> int:
        """Most context tokens among the sequences still in the dense warm-up window (0: none is)."""
        if compiling():
            # compiled decode steps run only where the window is at most top-k (the engine checks): the width
            # then never widens the pick, and the warm-up rows are marked unconditionally
            return 0
        if dg.lengths is not None:  # the plan's lengths: no tensor read
            return max((n for n in dg.lengths if n - 1 < self.warmup), default=0)
        in_warmup = dg.context_lens - 1 < self.warmup
        return int(dg.context_lens[in_warmup].max()) if bool(in_warmup.any()) else 0

    def _paged_scores(
        self, iq: torch.Tensor, iw: torch.Tensor, tables: list[list[int]], lengths: list[int], t: int
    ) -> torch.Tensor:
        """(D, T) index scores read from the cache in place (no gather copy of the keys)."""
        assert self.attn.indexer is not None
        scale = self.attn.indexer.softmax_scale
        scores = torch.full((len(tables), t), float("-inf"), device=iq.device)
        for i, (table, length) in enumerate(zip(tables, lengths, strict=True)):
            parts = []
            for first, n in self.cache.runs(table, length):
                keys, key_scale = self.cache.index_run(self.attn.index_layer, first, n)
                parts.append(self.kernels.index_scores_flat(keys, key_scale, iq[i], iw[i], scale))
            scores[i, :length] = torch.cat(parts)
        return scores

    def prefill(self, i: int) -> Picked:
        chunk = self.batch.prefills[i]
        t, n = chunk.context_len, chunk.length
        slots = self._slots(chunk.block_table, t)  # (T,)
        qpos = torch.arange(t - n, t, device=slots.device)
        causal = torch.arange(t, device=slots.device)[None] <= qpos[:, None]  # (n, T)
        if t <= self.topk or self.index is None:
            return Picked(slots, causal, shared=True)
        iq, iw = self.index
        keys = self.cache.gather_index(self.attn.index_layer, slots, torch.float32)  # (T, Di)
        heads = iq.shape[1]
        tile = max(1, INDEX_TILE_ELEMENTS // (heads * t))
        width = min(self.warmup, t)
        in_warmup = qpos < self.warmup
        kk = min(t, max(self.topk, width))  # what _top picks per row
        picks_idx, picks_valid = [], []
        for s in range(0, n, tile):
            e = min(n, s + tile)
            if t - n + e - 1 < self.topk:
                # no row of this tile sees more than top-k tokens: each picks all it sees, nothing to score
                picks_idx.append(torch.arange(kk, device=slots.device).expand(e - s, kk))
                picks_valid.append(causal[s:e, :kk])
                continue
            rows = slice(chunk.start + s, chunk.start + e)
            # causal: keys past the tile's last row are not scored (up to kk, so that top-k has its width);
            # the picks index the context from its start either way
            cut = min(t, max(t - n + e, kk))
            scores = self._scores(iq[None, rows], iw[None, rows], keys[None, :cut])[0]  # (t, cut)
            scores = scores.masked_fill(~causal[s:e, :cut], float("-inf"))
            idx, valid = self._top(scores, in_warmup[s:e], width, bool(in_warmup[s:e].any()))
            picks_idx.append(idx)
            picks_valid.append(valid)
        idx, valid = torch.cat(picks_idx), torch.cat(picks_valid)
        ratio = self.dense_ratio * (self.attn.expanded_mask_gain() if self.attn.expanded_pays(n, t) else 1.0)
        if t <= ratio * idx.shape[1]:
            # short contexts: one product over the context with the picks as a mask beats gathering k rows
            # per query (n * k rows instead of T); the result is the same
            mask = torch.zeros(n, t, dtype=torch.bool, device=idx.device).scatter_(1, idx, valid)
            return Picked(slots, mask, shared=True)
        return Picked(slots[idx], valid, shared=False)
