"""The numbers: block FP8 (amax / 448 per block), symmetric INT4 by round-to-nearest (amax / 7.5 per group, the
compressed-tensors min-max convention) or by GPTQ (Frantar et al. 2022: quantize columns in order, spreading
each column's error over the columns not yet quantized through the inverse Hessian of the layer's inputs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.errors import ConfigError
from glm5.model.quant import FP8

FP8_MAX = 448.0
INT4_MIN, INT4_MAX, INT4_HALF_RANGE = -8, 7, 7.5
_TINY = 1e-12


def fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) float -> (R, C) float8_e4m3fn and (ceil(R/br), ceil(C/bc)) float32 scales (weight = q x scale)."""
    rows, cols = w.shape
    br, bc = block
    padded = F.pad(w.float(), (0, -cols % bc, 0, -rows % br))
    tiles = padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_TINY)
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(FP8)
    return q, scale


def _group_scales(w: torch.Tensor, group: int) -> torch.Tensor:
    return (w.view(w.shape[0], -1, group).abs().amax(-1) / INT4_HALF_RANGE).clamp(min=_TINY)


def int4_rtn(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) float -> (R, C) int8 values in [-8, 7] and (R, C/group) float32 scales."""
    w = w.float()
    scale = _group_scales(w, group)
    q = torch.round(w / scale.repeat_interleave(group, dim=1)).clamp(INT4_MIN, INT4_MAX)
    return q.to(torch.int8), scale


def int4_gptq(
    w: torch.Tensor, hessian: torch.Tensor, group: int, damp: float = 0.01, block: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ with per-group scales fixed when the group's first column is reached (from the error-updated
    weights). `hessian` is sum(x^T x) over the calibration inputs (any positive multiple works)."""
    w = w.float().clone()
    rows, cols = w.shape
    h = hessian.double().clone()
    dead = torch.diag(h) == 0  # inputs never seen: their columns cannot matter, quantize them as zeros
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += torch.eye(cols, dtype=h.dtype) * damp * torch.diag(h).mean()
    try:
        upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    except RuntimeError as exc:  # torch.linalg.LinAlgError
        raise ConfigError(f"GPTQ: the calibration Hessian is not positive definite ({exc}); raise damp") from exc
    q = torch.zeros(rows, cols, dtype=torch.int8)
    scale = torch.zeros(rows, cols // group)
    block = max(group, block - block % group)  # a group never straddles two blocks
    for start in range(0, cols, block):
        stop = min(start + block, cols)
        wb, err = w[:, start:stop].clone(), torch.zeros(rows, stop - start)
        hb = upper[start:stop, start:stop]
        for i in range(stop - start):
            col = start + i
            if col % group == 0:
                scale[:, col // group] = _group_scales(wb[:, i : i + group], group)[:, 0]
            s = scale[:, col // group]
            qi = torch.round(wb[:, i] / s).clamp(INT4_MIN, INT4_MAX)
            q[:, col] = qi.to(torch.int8)
            e = (wb[:, i] - qi * s) / hb[i, i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, stop:] -= err @ upper[start:stop, stop:]
    return q, scale
