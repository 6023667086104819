"""Quantized weights as checkpoints publish them: block-scaled FP8 (GLM-5-FP8, DeepSeek-V3's format).

A quantized linear keeps its weight in 1 byte per value (float8_e4m3fn) with one float32 `weight_scale_inv` per
block of `block` = (rows, columns) values (the last blocks may be partial: kv_a_proj_with_mqa has 576 rows), so
`weight = fp8 x scale_inv` block by block. Which layers are quantized is what the checkpoint stores (a float8
weight with its `_scale_inv`), never a list of names. Compute dequantizes one layer's weight when it runs (the
portable path; a block-scaled matmul on devices that have one is future work): memory holds 1 byte per value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from glm5.errors import CheckpointError

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """A checkpoint's `quantization_config` (only what changes how tensors are read)."""

    method: str
    block: tuple[int, int]

    @classmethod
    def from_config(cls, raw: dict[str, Any] | None) -> QuantConfig | None:
        if not raw:
            return None
        method = raw.get("quant_method", "unknown")
        if method != "fp8":
            raise CheckpointError(
                f"quantized checkpoints ({method}) are not supported yet; use a bf16 or a block-FP8 checkpoint"
            )
        if raw.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"FP8 format {raw.get('fmt')!r} is not supported; only e4m3")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise CheckpointError("FP8 with static activation scales is not supported; only activation_scheme dynamic")
        block = raw.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(
                f"FP8 checkpoints need weight_block_size [rows, columns] in quantization_config, got {block!r}"
            )
        return cls(method, (block[0], block[1]))


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """(R, C) float8 and its (ceil(R/br), ceil(C/bc)) scales -> (R, C) in `dtype`."""
    rows, cols = weight.shape
    s = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return (weight.to(torch.float32) * s).to(dtype)


class Fp8Linear(nn.Module):
    """A linear layer whose weight is block-scaled FP8; same parameter names as the checkpoint's."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, block: tuple[int, int], dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block, self.dtype = in_features, out_features, block, dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(*scale_shape(out_features, in_features, block), dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, self.block, dtype or self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(x.dtype), self.bias)


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight in `dtype`, whatever it is stored as."""
    if isinstance(linear, Fp8Linear):
        return linear.dense_weight(dtype)
    assert isinstance(linear, nn.Linear)
    return linear.weight


def stacked_dequantize(
    weight: torch.Tensor, scale: torch.Tensor, parts: int, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """`parts` equal row blocks stacked in one tensor (gate and up), each with its own scale rows (a part's
    blocks start at its own first row, as when each was quantized on its own)."""
    rows, srows = weight.shape[0] // parts, scale.shape[0] // parts
    return torch.cat([
        dequantize(weight[p * rows : (p + 1) * rows], scale[p * srows : (p + 1) * srows], block, dtype)
        for p in range(parts)
    ])  # fmt: skip
