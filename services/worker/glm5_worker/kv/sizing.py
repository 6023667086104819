"""How big the KV pool is, and how it splits into the L1 (model precision or --kv-cache-dtype) and L2 (INT8) tiers.

MLA caches, per token and layer, the compressed latent and the shared rope key instead of expanded K/V, and
DSA adds one indexer key per token on layers that run their own indexer. Bytes per token (all layers):

    L1: b * [ L * (kv_lora_rank + qk_rope_head_dim) + L_idx * index_head_dim ]        (b = dtype bytes)
    L2:     L * (kv_lora_rank + qk_rope_head_dim) + L_idx * index_head_dim + 2 * (2 * L + L_idx)
            (INT8 values, plus a float16 scale per latent, rope key and indexer key)

where L is num_hidden_layers and L_idx the layers whose indexer_types entry is "full"; with MTP speculative
decoding each MTP layer adds one to both (its own latent rows and its own indexer keys, cache layer L + i).
The expanded-K/V formula of the source material, 2 * L * heads * head_dim * b, is ~50x larger for GLM-5. For GLM-5
(L = 78, 512 + 64 latent/rope, 128-dim indexer keys on every layer) in bfloat16 that is 109,824 bytes per
token, 14.4 GB for one 131072-token sequence; with the L2 tier, about 0.51x of that.

`auto` sizing: the pool gets min(budget, what max_num_seqs sequences of max_model_len tokens need), where
budget = kv_memory_fraction * free device memory (host MemAvailable on CPU, capped at kv_cpu_max_bytes),
and start-up fails with a clear message when not even one max_model_len sequence fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from glm5.errors import CapacityError
from glm5.kvcache.storage import KVLayout
from glm5.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class PoolPlan:
    num_fp_blocks: int
    num_q_blocks: int
    fp_bytes_per_token: int
    q_bytes_per_token: int
    block_size: int

    @property
    def total_bytes(self) -> int:
        per_block = self.block_size
        return per_block * (self.num_fp_blocks * self.fp_bytes_per_token + self.num_q_blocks * self.q_bytes_per_token)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_fp_blocks + self.num_q_blocks) * self.block_size


def make_layout(
    config: ModelConfig,
    block_size: int,
    num_fp_blocks: int,
    num_q_blocks: int,
    dtype: torch.dtype,
    device: torch.device,
    index_dtype: torch.dtype | None = None,
    mtp_layers: int = 0,
) -> KVLayout:
    """The pool's layout; `mtp_layers` MTP layers get rows after the decoder layers', each with its own indexer
    keys (glm5.model.model.MTPLayer's cache layer L + i)."""
    index_layers = {layer: i for i, layer in enumerate(config.full_indexer_layers)}
    slots = tuple(index_layers.get(i, -1) for i in range(config.num_hidden_layers))
    return KVLayout(
        num_layers=config.num_hidden_layers + mtp_layers,
        kv_lora_rank=config.kv_lora_rank,
        rope_dim=config.qk_rope_head_dim,
        index_dim=config.index_head_dim,
        index_slot_of_layer=slots + tuple(range(len(index_layers), len(index_layers) + mtp_layers)),
        block_size=block_size,
        num_fp_blocks=num_fp_blocks,
        num_q_blocks=num_q_blocks,
        dtype=dtype,
        device=device,
        index_dtype=index_dtype,
    )


def per_token_bytes(
    config: ModelConfig, dtype: torch.dtype, index_dtype: torch.dtype | None = None, mtp_layers: int = 0
) -> tuple[int, int]:
    """(L1 bytes, L2 bytes) per token over all layers."""
    layout = make_layout(config, 1, 0, 0, dtype, torch.device("cpu"), index_dtype, mtp_layers)
    return layout.fp_bytes_per_token(), layout.q_bytes_per_token()


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Everything the pool's size depends on but the bytes it may take. Under tensor parallelism every rank
    caches the whole latent of every token (the heads split, the latent does not), so this is per rank."""

    model: ModelConfig
    dtype: torch.dtype  # L1 latents and rope keys
    index_dtype: torch.dtype | None  # L1 indexer keys (None: dtype)
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_chunk: int  # tokens one step may prefill
    l1_tokens: int
    int8_tier: bool
    mtp_layers: int = 0  # MTP layers with cache rows (speculative decoding)

    @property
    def per_token(self) -> tuple[int, int]:
        return per_token_bytes(self.model, self.dtype, self.index_dtype, self.mtp_layers)

    def bytes_for_one_sequence(self) -> int:
        fp_tok, q_tok = self.per_token
        blocks = -(-self.max_model_len // self.block_size)
        if not self.int8_tier:
            return blocks * self.block_size * fp_tok
        l1 = l1_blocks_per_seq(self.block_size, self.l1_tokens) + l1_blocks_for_chunk(self.block_size, self.max_chunk)
        return self.block_size * (l1 * fp_tok + blocks * q_tok)


def l1_blocks_per_seq(block_size: int, l1_tokens: int) -> int:
    """L1 blocks one decoding sequence holds: its window, the block being filled, one awaiting demotion."""
    return -(-l1_tokens // block_size) + 2


def l1_blocks_for_chunk(block_size: int, max_chunk: int) -> int:
    """L1 blocks one step's prefill chunks can fill before they are demoted after the step."""
    return -(-max_chunk // block_size) + 1


def plan_pool(spec: CacheSpec, total_bytes: int) -> PoolPlan:
    """Splits `total_bytes` into tiers; raises CapacityError if one max_model_len sequence cannot fit."""
    fp_tok, q_tok = spec.per_token
    need_one = spec.bytes_for_one_sequence()
    if total_bytes < need_one:
        raise CapacityError(
            f"the KV cache needs {need_one / 2**20:.1f} MiB to hold one sequence of max_model_len="
            f"{spec.max_model_len} tokens ({fp_tok} B/token in L1"
            + (f", {q_tok} B/token in the INT8 tier" if spec.int8_tier else "")
            + f") but only {total_bytes / 2**20:.1f} MiB are available; lower --max-model-len or raise "
            "--kv-cache-bytes"
        )
    bs = spec.block_size
    if not spec.int8_tier:
        return PoolPlan(total_bytes // (fp_tok * bs), 0, fp_tok, q_tok, bs)
    # L1 for every running sequence's window plus one step of prefill; at most half of the pool
    per_seq, chunk = l1_blocks_per_seq(bs, spec.l1_tokens), l1_blocks_for_chunk(bs, spec.max_chunk)
    min_fp, want_fp = per_seq + chunk, spec.max_num_seqs * per_seq + chunk
    half = total_bytes // 2 // (fp_tok * bs)
    num_fp = max(min_fp, min(want_fp, half))
    num_q = (total_bytes - num_fp * fp_tok * bs) // (q_tok * bs)
    return PoolPlan(num_fp, int(num_q), fp_tok, q_tok, bs)


def auto_bytes(spec: CacheSpec, available: int, fraction: float, cap: int | None) -> int:
    """min(fraction x available (capped), what max_num_seqs sequences of max_model_len tokens need)."""
    budget = int(available * fraction)
    if cap is not None:
        budget = min(budget, cap)
    return min(budget, spec.bytes_for_one_sequence() * spec.max_num_seqs)
