"""Linear layers that read the same input, run as one matrix product (a serving-time rearrangement).

A decode step at small batch is dispatch-bound: each product is a separate kernel call (an extern call in a
compiled graph), so the projections of one input (MLA's q_a / kv_a and the indexer's wk / weights_proj; an MLP's
gate / up) cost less as one. The layers keep their parameters under their own names, as views of the fused
matrix's rows: checkpoint names, weight swaps and `named_parameters` are unchanged, and an in-place copy into a
layer's weight (RL's weight sync) reaches the fused matrix.
"""

from __future__ import annotations

import torch
from torch import nn

Fused = tuple[torch.Tensor, list[int]]  # the fused weight (sum of out features, in), each layer's rows


def fuse_rows(parts: list[nn.Module]) -> Fused | None:
    """The longest prefix (at least two) of `parts` that are plain unbiased nn.Linear layers with weights of
    one dtype and device, fused; None when fewer than two qualify (a quantized layer, a float32-kept one in a
    bfloat16 model). Call on a model that is in its final place: moving it afterwards (`.to`) would separate
    the views from the fused matrix."""
    first = parts[0]
    if type(first) is not nn.Linear:
        return None
    dtype, device = first.weight.dtype, first.weight.device
    n = 0
    for p in parts:
        if type(p) is not nn.Linear or p.bias is not None or p.weight.dtype != dtype or p.weight.device != device:
            break
        n += 1
    if n < 2:
        return None
    linears = [p for p in parts[:n] if isinstance(p, nn.Linear)]
    fused = torch.cat([p.weight.detach() for p in linears])
    rows = [p.weight.shape[0] for p in linears]
    start = 0
    for p, r in zip(linears, rows, strict=True):
        p.weight = nn.Parameter(fused[start : start + r], requires_grad=False)
        start += r
    return fused, rows


def run_fused(x: torch.Tensor, fused: Fused) -> tuple[torch.Tensor, ...]:
    """Each fused layer's output of `x`."""
    return tuple(torch.split(nn.functional.linear(x, fused[0]), fused[1], dim=-1))
