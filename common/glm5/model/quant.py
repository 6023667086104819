"""Quantized weights as checkpoints publish them.

Two formats, each read as stored (memory holds the quantized bytes, never a float copy of the model):
- block-scaled FP8 (GLM-5-FP8, DeepSeek-V3's format; `quant_method: fp8`): a float8_e4m3fn weight with one
  float32 `weight_scale_inv` per block of `block` = (rows, columns) values (the last blocks may be partial:
  kv_a_proj_with_mqa has 576 rows), so `weight = fp8 x scale_inv` block by block. compressed-tensors'
  `float-quantized` block format is the same numbers under the name `weight_scale`.
- compressed-tensors `pack-quantized` INT4 (the community W4A16 checkpoints): symmetric int4 values packed eight
  to an int32 (`weight_packed`, element i at bits 4i..4i+3, offset by +8), one scale per `group` input columns
  of a row or one per row (strategy channel) (`weight_scale`), the logical shape in `weight_shape`:
  `weight = int4 x scale` group by group (a last partial group, which compressed-tensors does not write, covers
  the remaining columns).
Which layers are quantized, and how, is what the checkpoint stores (a float8 weight with its scale, a
`weight_packed`), checked against its `quantization_config`; never a list of names.

Compute: a layer's weight is dequantized when it runs (the portable path), except INT4 with bfloat16
activations on a CPU, which uses PyTorch's own int4 CPU matmul (`_weight_int4pack_mm_for_cpu`, the kernel
torchao's Int4CPULayout calls) on weights repacked for it at load.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from glm5.errors import CheckpointError

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
INT4_PER_WORD = 8
# the CPU kernel's weight layout needs output features in multiples of 16
_CPU_KERNEL_ROWS = 16


@dataclass(frozen=True, slots=True)
class QuantGroup:
    """One compressed-tensors config group: which modules, and how their weights are stored."""

    targets: tuple[str, ...]
    kind: str  # "int" or "float"
    num_bits: int
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None
    symmetric: bool

    def matches(self, module: str) -> bool:
        return any(_target_matches(t, module) for t in self.targets)


def _target_matches(target: str, module: str) -> bool:
    """compressed-tensors' target syntax: `re:<regex>` on the module name, a class name (`Linear`: every
    quantized tensor here is a linear layer's weight), or a module name (exact or as a suffix)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or module == target or module.endswith("." + target)


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """A checkpoint's `quantization_config` (only what changes how tensors are read)."""

    method: str
    block: tuple[int, int] | None = None  # quant_method fp8
    groups: tuple[QuantGroup, ...] = ()  # quant_method compressed-tensors

    @classmethod
    def from_config(cls, raw: dict[str, Any] | None) -> QuantConfig | None:
        if not raw:
            return None
        method = raw.get("quant_method", "unknown")
        if method == "fp8":
            return cls._fp8(raw)
        if method == "compressed-tensors":
            return cls._compressed_tensors(raw)
        raise CheckpointError(
            f"quantized checkpoints ({method}) are not supported; use bf16, block-FP8 (quant_method fp8) or "
            "compressed-tensors (pack-quantized INT4, block FP8)"
        )

    @classmethod
    def _fp8(cls, raw: dict[str, Any]) -> QuantConfig:
        if raw.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"FP8 format {raw.get('fmt')!r} is not supported; only e4m3")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise CheckpointError("FP8 with static activation scales is not supported; only activation_scheme dynamic")
        return cls("fp8", block=_pair(raw.get("weight_block_size"), "weight_block_size in quantization_config"))

    @classmethod
    def _compressed_tensors(cls, raw: dict[str, Any]) -> QuantConfig:
        groups = raw.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise CheckpointError("a compressed-tensors quantization_config needs config_groups")
        parsed = []
        for key, group in groups.items():
            weights = group.get("weights") if isinstance(group, dict) else None
            if not isinstance(weights, dict):
                raise CheckpointError(f"config group {key} has no weights arguments")
            inputs = group.get("input_activations")
            if inputs and not inputs.get("dynamic", False):
                raise CheckpointError(f"config group {key}: static activation scales are not supported")
            kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
            strategy = weights.get("strategy", "tensor")
            block = None
            if kind == "float" and strategy == "block":
                block = _pair(weights.get("block_structure"), f"config group {key}'s block_structure")
            gsize = weights.get("group_size")
            symmetric = bool(weights.get("symmetric", True))
            targets = tuple(group.get("targets") or ())
            parsed.append(QuantGroup(targets, kind, bits, strategy, int(gsize) if gsize else None, block, symmetric))
        return cls("compressed-tensors", groups=tuple(parsed))

    def group_for(self, module: str) -> QuantGroup | None:
        return next((g for g in self.groups if g.matches(module)), None)

    def fp8_block(self, module: str) -> tuple[int, int]:
        """The scale block of `module`'s float8 weight."""
        if self.method == "fp8":
            assert self.block is not None
            return self.block
        group = self.group_for(module)
        if group is None or group.kind != "float" or group.num_bits != 8 or group.block is None:
            raise CheckpointError(
                f"{module}.weight is float8 but no config group quantizes it as block FP8 "
                "(only strategy block with a block_structure is supported)"
            )
        return group.block

    def int4_group(self, module: str) -> int | None:
        """The number of input columns sharing one scale in `module`'s packed INT4 weight; None for one scale per
        row (strategy channel), whatever the row's length or the part of it a rank holds."""
        group = self.group_for(module) if self.method == "compressed-tensors" else None
        if group is None:
            raise CheckpointError(f"{module}.weight_packed is stored but no config group of the checkpoint targets it")
        if group.kind != "int" or group.num_bits != 4 or not group.symmetric:
            raise CheckpointError(
                f"{module}: {'symmetric' if group.symmetric else 'asymmetric'} {group.kind}{group.num_bits} packed "
                "weights are not supported; only symmetric int4"
            )
        if group.strategy == "channel":
            return None
        if group.strategy != "group" or not group.group_size:
            raise CheckpointError(f"{module}: int4 strategy {group.strategy!r} is not supported; use group or channel")
        return group.group_size


QUANTIZATION_CHOICES = ("auto", "none", "fp8", "compressed-tensors")


def check_quantization(expected: str, raw_config: dict[str, Any], path: str) -> str:
    """The checkpoint's quantization method ('none' when unquantized), which must be `expected` unless that is
    'auto' (vLLM's --quantization: a deployment that asks for a format fails at start-up on another)."""
    qc = raw_config.get("quantization_config") or {}
    found = str(qc.get("quant_method", "unknown")) if qc else "none"
    if expected not in QUANTIZATION_CHOICES:
        raise CheckpointError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {expected!r}")
    if expected != "auto" and expected != found:
        hint = {"none": "a float checkpoint", "fp8": "`glm5 quantize --scheme fp8-block`",
                "compressed-tensors": "`glm5 quantize --scheme w4a16` (or w4a16-fp8-mix)"}[expected]  # fmt: skip
        raise CheckpointError(
            f"--quantization {expected} but the checkpoint at {path} is {found}; use {hint}, or --quantization auto"
        )
    return found


def _pair(value: Any, what: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(b, int) and b > 0 for b in value)):
        raise CheckpointError(f"FP8 checkpoints need {what} as [rows, columns], got {value!r}")
    return value[0], value[1]


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """(R, C) float8 and its (ceil(R/br), ceil(C/bc)) scales -> (R, C) in `dtype`."""
    rows, cols = weight.shape
    values = fp8_to_float32(weight)
    br, bc = block
    if rows % br == 0 and cols % bc == 0:  # whole blocks: scale through a view, no (R, C) scale tensor
        values.view(rows // br, br, cols // bc, bc).mul_(scale[:, None, :, None].float())
    else:
        values.mul_(scale.float().repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols])
    return values.to(dtype)


_FP8_TABLES: dict[torch.device, torch.Tensor] = {}


def fp8_to_float32(weight: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32. On a CPU through a 256-entry table: the CPU has no FP8 conversion instruction and
    PyTorch's elementwise cast costs ~2.5 ns per value, the table lookup less than half of that."""
    if weight.device.type != "cpu":
        return weight.to(torch.float32)
    table = _FP8_TABLES.get(weight.device)
    if table is None:
        table = _FP8_TABLES[weight.device] = torch.arange(256, dtype=torch.uint8).view(FP8).to(torch.float32)
    return torch.take(table, weight.view(torch.uint8).long())


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


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """(R, ceil(C/8)) int32 words -> (R, C) int8 in [-8, 7]. A 4-bit value never straddles a byte, so the
    words' bytes are split into nibbles (low nibble first) instead of shifting words."""
    rows = packed.shape[0]
    nibbles = packed.contiguous().view(torch.uint8)
    if sys.byteorder == "big" and packed.device.type == "cpu":
        nibbles = nibbles.view(rows, -1, 4).flip(-1)
    out = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(rows, -1)[:, :cols]
    return out.view(torch.int8) - 8


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_int4: (R, C) integers in [-8, 7] -> (R, ceil(C/8)) int32."""
    rows, cols = values.shape
    u = (values.to(torch.int32) + 8).to(torch.uint8)
    u = F.pad(u, (0, -cols % INT4_PER_WORD))
    bytes_ = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
    if sys.byteorder == "big":
        bytes_ = bytes_.view(rows, -1, 4).flip(-1).contiguous()
    return bytes_.view(torch.int32)


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, cols: int, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """(R, ceil(C/8)) packed int4 and its (R, ceil(C/group)) scales -> (R, C) in `dtype` (the last group may be
    partial). The group is given, not derived from the scales' shape: 160 columns in groups of 128 have two
    scales per row, which would read as groups of 80."""
    rows = packed.shape[0]
    assert scale.shape[1] == math.ceil(cols / group), (tuple(scale.shape), cols, group)
    values = unpack_int4(packed, cols).to(torch.float32)
    if cols % group == 0:  # whole groups: scale through a view, no (R, C) scale tensor
        values.view(rows, cols // group, group).mul_(scale[:, :, None].float())
    else:
        values.mul_(scale.float().repeat_interleave(group, dim=1)[:, :cols])
    return values.to(dtype)


class CpuInt4:
    """One INT4 matrix repacked for PyTorch's CPU int4 matmul (bfloat16 activations)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, cols: int, group: int) -> None:
        self.group = group
        unsigned = unpack_int4(packed, cols).to(torch.int32) + 8
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
        # the kernel computes (q - 8) * scale + zero: symmetric int4 has zero 0
        zeros = torch.zeros_like(scale.t())
        self.scales_and_zeros = torch.stack([scale.t(), zeros], dim=-1).to(torch.bfloat16).contiguous()

    @staticmethod
    def fits(rows: int, cols: int, group: int, device: torch.device) -> bool:
        shapes_fit = rows % _CPU_KERNEL_ROWS == 0 and cols % group == 0 and group in (32, 64, 128, 256)
        return device.type == "cpu" and shapes_fit and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group,
                                                                      self.scales_and_zeros)  # fmt: skip
        return out.view(*x.shape[:-1], out.shape[-1])


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


class Int4Linear(nn.Module):
    """A linear layer whose weight is compressed-tensors pack-quantized INT4; the checkpoint's parameter names
    (`weight_packed`, `weight_scale`). `group` None: one scale per row (channel)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group, self.dtype = in_features, out_features, group, dtype
        frozen = dict(requires_grad=False)
        packed_cols = math.ceil(in_features / INT4_PER_WORD)
        self.weight_packed = nn.Parameter(torch.empty(out_features, packed_cols, dtype=torch.int32), **frozen)
        scales = math.ceil(in_features / self.cols_per_scale)
        self.weight_scale = nn.Parameter(torch.empty(out_features, scales), **frozen)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.cpu_kernel: CpuInt4 | None = None

    @property
    def cols_per_scale(self) -> int:
        return self.group or self.in_features

    def use_cpu_kernel(self) -> None:
        """Repacks the weight for the CPU int4 matmul (bfloat16 compute) and frees the checkpoint layout."""
        group = self.cols_per_scale
        if CpuInt4.fits(self.out_features, self.in_features, group, self.weight_packed.device):
            self.cpu_kernel = CpuInt4(self.weight_packed, self.weight_scale, self.in_features, group)
            self.weight_packed = nn.Parameter(self.cpu_kernel.weight, requires_grad=False)

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.cpu_kernel is not None:
            eye = torch.eye(self.in_features, dtype=torch.bfloat16)
            return self.cpu_kernel.matmul(eye).t().to(dtype or self.dtype)
        packed, scale, cols = self.weight_packed, self.weight_scale, self.in_features
        return dequantize_int4(packed, scale, cols, self.cols_per_scale, dtype or self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel is not None and x.dtype == torch.bfloat16:
            out = self.cpu_kernel.matmul(x)
            return out + self.bias if self.bias is not None else out
        return F.linear(x, self.dense_weight(x.dtype), self.bias)


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight in `dtype`, whatever it is stored as."""
    if isinstance(linear, Fp8Linear | Int4Linear):
        return linear.dense_weight(dtype)
    assert isinstance(linear, nn.Linear)
    return linear.weight
