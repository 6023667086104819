"""Expert parallelism in the trainer (issue 35): each rank holds whole routed experts and the tokens travel to
them, instead of FSDP2 gathering every expert of a layer onto every rank.

FSDP2 alone all-gathers a whole decoder layer for its forward and backward: for a GLM-5 MoE layer that is its
256 routed experts, 9.66B parameters, on every device whatever the world size (docs/scaling.md). Here a MoE
layer's stacked experts (transformers' `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I)) are DTensors
placed Shard(0) on the trainer's mesh, as FSDP2 places its own parameters (torch.chunk's rows of dim 0, so rank
r holds experts [r c, (r+1) c), c = ceil(E / N)), and FSDP2 leaves them alone (`ignored_params`). The forward
sends each (token, expert) pair to the rank that holds the expert (one all-to-all), runs the rank's experts on
what arrived, and sends the results back (a second all-to-all), as Megatron and slime train GLM-5; the
backward runs the same exchanges in reverse. Nothing else changes: parameter names, shapes and placements are
what checkpoints, DCP resharding, publishing and weight sync already read.

Gradients: each rank's experts see every rank's tokens, so their gradients are already the sum of every rank's
share of the loss, which is what FSDP2's reduce-scatter gives the other parameters (its divide factor is 1).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

STACKED = ("gate_up_proj", "down_proj")


class _AllToAll(torch.autograd.Function):
    """Rows of `x` sent in `send` counts to each rank, `receive` counts arriving; the backward sends the
    gradients back the same way reversed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, receive: list[int], send: list[int], group: Any) -> torch.Tensor:
        ctx.counts, ctx.group = (receive, send), group
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        receive, send = ctx.counts
        back = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send, receive, group=ctx.group)
        return back, None, None, None


def _exchange(x: torch.Tensor, receive: list[int], send: list[int], group: Any) -> torch.Tensor:
    out: torch.Tensor = _AllToAll.apply(x, receive, send, group)  # type: ignore[no-untyped-call]
    return out


def _rows(n: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the rows of dim 0 that `rank` holds under Shard(0) (torch.chunk's split)."""
    c = math.ceil(n / size)
    return min(rank * c, n), min((rank + 1) * c, n)


def _sharded(full: torch.Tensor, mesh: DeviceMesh) -> nn.Parameter:
    a, b = _rows(full.shape[0], mesh.size(), mesh.get_local_rank())
    local = full.detach()[a:b].contiguous()
    placed = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    return nn.Parameter(placed, requires_grad=full.requires_grad)


class ExpertParallel(nn.Module):
    """A MoE layer's routed experts, this rank's share of them, called as transformers' experts module is:
    (tokens, hidden) states, each token's top-k expert ids and weights -> the weighted sum of its experts'
    outputs. `compute_dtype`: the experts' weights are cast to it for the matmuls (bf16 under FSDP2's mixed
    precision; the parameters and their gradients stay in their own dtype)."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh, group: Any, compute_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.num_experts = int(experts.get_parameter("gate_up_proj").shape[0])
        self.act_fn: nn.Module = experts.get_submodule("act_fn")
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.group = group
        self.compute_dtype = compute_dtype
        self.gate_up_proj = _sharded(experts.get_parameter("gate_up_proj"), mesh)
        self.down_proj = _sharded(experts.get_parameter("down_proj"), mesh)

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        t = p.to_local() if isinstance(p, DTensor) else p
        return t if self.compute_dtype is None else t.to(self.compute_dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        # the (token, expert) pairs grouped by expert, so by the rank that holds it; ids outside [0, E) are
        # transformers' "no expert" padding and go nowhere
        order = torch.argsort(chosen, stable=True)
        order = order[(chosen[order] >= 0) & (chosen[order] < self.num_experts)]
        experts = chosen[order]
        tokens = order // k
        per_rank = math.ceil(self.num_experts / self.size)
        send = torch.bincount(experts // per_rank, minlength=self.size)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=self.group)
        send_l, receive_l = send.tolist(), receive.tolist()
        x = _exchange(hidden_states[tokens], receive_l, send_l, self.group)
        arrived = torch.empty(sum(receive_l), dtype=experts.dtype, device=experts.device)
        dist.all_to_all_single(arrived, experts, receive_l, send_l, group=self.group)

        gate_up, down = self._local(self.gate_up_proj), self._local(self.down_proj)
        first = _rows(self.num_experts, self.size, self.rank)[0]
        y = x.new_zeros((x.shape[0], down.shape[1]))
        for j in range(gate_up.shape[0]):
            (rows,) = torch.where(arrived == first + j)
            if rows.numel() == 0:
                continue
            gate, up = nn.functional.linear(x[rows].to(gate_up.dtype), gate_up[j]).chunk(2, dim=-1)
            out = nn.functional.linear(self.act_fn(gate) * up, down[j])
            y = y.index_copy(0, rows, out.to(y.dtype))
        back = _exchange(y, send_l, receive_l, self.group)
        weights = top_k_weights.reshape(-1)[order, None]
        final = torch.zeros_like(hidden_states)
        return final.index_add(0, tokens, (back * weights).to(final.dtype))


def parallelize_experts(model: nn.Module, mesh: DeviceMesh, group: Any,
                        compute_dtype: torch.dtype | None = None) -> set[nn.Parameter]:  # fmt: skip
    """Replaces every MoE layer's stacked experts with `ExpertParallel` over `mesh` (in place, on the meta device
    or with real weights); returns the parameters it placed, which FSDP2 must then ignore."""
    placed: set[nn.Parameter] = set()
    for name, module in list(model.named_modules()):
        stacked = all(isinstance(getattr(module, s, None), nn.Parameter) for s in STACKED)
        if not stacked or not hasattr(module, "act_fn"):
            continue
        parent, _, attr = name.rpartition(".")
        ep = ExpertParallel(module, mesh, group, compute_dtype)
        setattr(model.get_submodule(parent), attr, ep)
        placed.update((ep.gate_up_proj, ep.down_proj))
    return placed
