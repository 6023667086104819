"""A step and a rank's memory as plain data: rank 0 sends a `StepPlan` to the other ranks, each reports its
`RankMemory`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepPlan:
    """One forward step, as rank 0 decided it. Rows: decode tokens first, then each prefill chunk's tokens."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # L1 slot each new token is written to
    decode_tables: list[list[int]]  # block table of each decoding sequence (empty: no decodes)
    decode_lengths: list[int]  # tokens in context of each decoding sequence, including the new one
    prefills: list[tuple[int, int, int, list[int]]]  # (first row, length, context_len, block table) per chunk
    logits_rows: list[int]
    layer_topk: list[int] | None = None
    collect_entropy: bool = False
    # L1 -> L2 block copies decided after the previous step; followers apply them before this step (rank 0
    # already has)
    demotions: list[tuple[int, int]] = field(default_factory=list)
    keep_hidden: bool = False  # keep every row's last hidden state (ModelRunner.hidden) for an MTP pass


@dataclass(frozen=True, slots=True)
class RankMemory:
    rank: int
    weight_bytes: int
    kv_bytes: int
    device_bytes: int  # allocated on the accelerator (0 on CPU)
    host_rss_bytes: int  # peak resident set of the rank's process
    weight_bytes_by_dtype: dict[str, int] = field(default_factory=dict)  # float8_e4m3fn, bfloat16, ...
