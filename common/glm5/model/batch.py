"""What one model step computes: a packed batch of decode tokens and prefill chunks over the paged cache.

The engine builds it; the model only reads it. Rows of the packed batch are ordered decode tokens first
(one per running sequence), then each prefill chunk's tokens in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class DecodeGroup:
    """`num_seqs` sequences that each add one token; rows [0, num_seqs) of the batch."""

    num_seqs: int
    block_tables: torch.Tensor  # (D, max_blocks) int64 unified block ids, padded with 0
    context_lens: torch.Tensor  # (D,) int64, tokens in context including the new one
    max_context: int
    # the same tables and lengths as Python lists, for kernels that read contiguous block runs in place
    tables: list[list[int]] | None = None
    lengths: list[int] | None = None


@dataclass(slots=True)
class PrefillChunk:
    """`length` prompt tokens of one sequence at positions [context_len - length, context_len)."""

    start: int  # first row in the packed batch
    length: int
    context_len: int
    block_table: torch.Tensor  # (num_blocks,) int64 unified block ids covering context_len tokens


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    slot_mapping: torch.Tensor  # (N,) int64 L1 slot of each new token
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    logits_rows: torch.Tensor  # (M,) rows whose logits the caller needs
    # per layer top-k override from the dynamic sparsity controller (None: index_topk everywhere)
    layer_topk: list[int] | None = None
    # collect per-layer sparse-attention entropy this step (costs a little; sampled by the engine)
    collect_entropy: bool = False
    entropy: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer, 0-d
