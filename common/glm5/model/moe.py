"""Feed-forward blocks: the dense SwiGLU MLP and the DeepSeek-V3-style mixture of experts.

Routing (transformers' GlmMoeDsaTopkRouter): sigmoid scores in float32; the choice adds
e_score_correction_bias (aux-loss-free balancing) but the weights do not; experts are first limited to the
topk_group groups whose two best experts score highest; chosen weights are normalised (norm_topk_prob)
and multiplied by routed_scaling_factor. Shared experts always run.

Under tensor parallelism (glm5.parallel) the blocks return this rank's partial sum; the decoder layer adds the
ranks' partials with one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from glm5.model.config import ModelConfig
from glm5.model.fused import Fused, fuse_rows, run_fused
from glm5.model.quant import (
    FP8,
    INT4_PER_WORD,
    CpuInt4,
    dequantize,
    dequantize_int4,
    scale_shape,
    stacked_dequantize,
)
from glm5.parallel import SINGLE, TensorParallel


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._fused: Fused | None = None  # fuse_input_projections()

    def fuse_input_projections(self) -> int:
        """gate and up as one product (glm5.model.fused); returns how many were fused."""
        if self._fused is None:
            self._fused = fuse_rows([self.gate_proj, self.up_proj])
            return len(self._fused[1]) if self._fused else 0
        return 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = run_fused(x, self._fused) if self._fused is not None else (self.gate_proj(x), self.up_proj(x))
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> logits (N, E) f32, weights (N, K) f32, expert ids (N, K)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        n = x.shape[0]
        grouped = choice.view(n, self.num_groups, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (N, G)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, -1)
        choice = choice.masked_fill(score_mask == 0, float("-inf"))
        expert_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.scaling, expert_ids


class Experts(nn.Module):
    """Routed experts stacked in 3-D tensors (one matmul per active expert). Under expert parallelism a rank
    holds experts [first_expert, first_expert + num_experts); otherwise every expert, with a 1/N slice of its
    intermediate dimension."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        if tp.expert_parallel:
            self.first_expert, stop = tp.span(e)
            e = stop - self.first_expert
        else:
            self.first_expert, i = 0, i // tp.size
        self.num_experts, self.total_experts = e, config.n_routed_experts
        self.dims = (i, d)  # this rank's (intermediate, hidden)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))  # rows: gate then up
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.fp8_block: tuple[int, int] | None = None
        self.is_int4 = False
        self.int4_group: int | None = None  # input columns per INT4 scale; None: one scale per row (channel)
        self.cpu_kernels: list[tuple[CpuInt4, CpuInt4]] | None = None
        # calibration (glm5 quantize): called with (global expert id, "gate_up" | "down", that projection's input)
        self.observer: Callable[[int, str, torch.Tensor], None] | None = None

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Block-FP8 weights (before loading): 1 byte per value plus `*_scale_inv`, the gate and up halves'
        scales stacked like their rows."""
        e, two_i, d = self.gate_up_proj.shape
        i, dev = two_i // 2, self.gate_up_proj.device
        gr, gc = scale_shape(i, d, block)
        dr, dc = scale_shape(d, i, block)
        frozen = dict(requires_grad=False)
        self.gate_up_proj = nn.Parameter(torch.empty(e, two_i, d, dtype=FP8, device=dev), **frozen)
        self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(e, 2 * gr, gc, device=dev), **frozen)
        self.down_proj = nn.Parameter(torch.empty(e, d, i, dtype=FP8, device=dev), **frozen)
        self.down_proj_scale_inv = nn.Parameter(torch.empty(e, dr, dc, device=dev), **frozen)
        self.fp8_block = block

    def to_int4(self, group: int | None) -> None:
        """Packed INT4 weights (before loading): `*_packed` int32 words of 8 values and `*_scale`, one per `group`
        input columns of a row, or one per row when `group` is None (gate and up rows stacked, their scales with
        them)."""
        e, two_i, d = self.gate_up_proj.shape
        i, dev = two_i // 2, self.gate_up_proj.device
        frozen = dict(requires_grad=False)
        del self.gate_up_proj, self.down_proj
        self.is_int4, self.int4_group = True, group
        words_d, words_i = math.ceil(d / INT4_PER_WORD), math.ceil(i / INT4_PER_WORD)
        scales_d, scales_i = math.ceil(d / self._cols_per_scale(d)), math.ceil(i / self._cols_per_scale(i))
        self.gate_up_proj_packed = nn.Parameter(torch.empty(e, two_i, words_d, dtype=torch.int32, device=dev), **frozen)
        self.gate_up_proj_scale = nn.Parameter(torch.empty(e, two_i, scales_d, device=dev), **frozen)
        self.down_proj_packed = nn.Parameter(torch.empty(e, d, words_i, dtype=torch.int32, device=dev), **frozen)
        self.down_proj_scale = nn.Parameter(torch.empty(e, d, scales_i, device=dev), **frozen)

    def _cols_per_scale(self, cols: int) -> int:
        """Input columns per INT4 scale of a projection with `cols` inputs: gate_up reads the hidden size, down
        the intermediate one, so a channel scale spans a different width in each."""
        return self.int4_group or cols

    def use_cpu_kernel(self) -> None:
        """Repacks INT4 experts for the CPU int4 matmul (bfloat16 compute), freeing the checkpoint layout."""
        if not self.is_int4:
            return
        (i, d), dev = self.dims, self.gate_up_proj_packed.device
        gd, gi = self._cols_per_scale(d), self._cols_per_scale(i)
        if not (CpuInt4.fits(2 * i, d, gd, dev) and CpuInt4.fits(d, i, gi, dev)):
            return
        self.cpu_kernels = [
            (CpuInt4(self.gate_up_proj_packed[e], self.gate_up_proj_scale[e], d, gd),
             CpuInt4(self.down_proj_packed[e], self.down_proj_scale[e], i, gi))
            for e in range(self.num_experts)
        ]  # fmt: skip
        frozen = dict(requires_grad=False)
        self.gate_up_proj_packed = nn.Parameter(torch.stack([k[0].weight for k in self.cpu_kernels]), **frozen)
        self.down_proj_packed = nn.Parameter(torch.stack([k[1].weight for k in self.cpu_kernels]), **frozen)
        for e, (gu, dn) in enumerate(self.cpu_kernels):  # share the stacked storage, do not hold two copies
            gu.weight, dn.weight = self.gate_up_proj_packed[e], self.down_proj_packed[e]

    def _gate_up(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.cpu_kernels is not None and x.dtype == torch.bfloat16:
            return self.cpu_kernels[e][0].matmul(x)
        if self.is_int4:
            d = self.dims[1]
            w = dequantize_int4(self.gate_up_proj_packed[e], self.gate_up_proj_scale[e], d, self._cols_per_scale(d),
                                x.dtype)  # fmt: skip
        elif self.fp8_block is not None:
            w = stacked_dequantize(self.gate_up_proj[e], self.gate_up_proj_scale_inv[e], 2, self.fp8_block, x.dtype)
        else:
            w = self.gate_up_proj[e]
        return F.linear(x, w)

    def _down(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.cpu_kernels is not None and x.dtype == torch.bfloat16:
            return self.cpu_kernels[e][1].matmul(x)
        if self.is_int4:
            i = self.dims[0]
            w = dequantize_int4(self.down_proj_packed[e], self.down_proj_scale[e], i, self._cols_per_scale(i),
                                x.dtype)  # fmt: skip
        elif self.fp8_block is not None:
            w = dequantize(self.down_proj[e], self.down_proj_scale_inv[e], self.fp8_block, x.dtype)
        else:
            w = self.down_proj[e]
        return F.linear(x, w)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and self._can_gather(expert_ids.numel()):
            return self._gathered(x, expert_ids, weights)
        out = torch.zeros_like(x)
        flat = expert_ids.reshape(-1)
        if self.first_expert:
            flat = flat - self.first_expert
        # another rank's experts go to a last bucket that is never run
        flat = flat.masked_fill((flat < 0) | (flat >= self.num_experts), self.num_experts)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1).tolist()[: self.num_experts]
        token_of = order // expert_ids.shape[1]
        slot_of = order % expert_ids.shape[1]
        start = 0
        # ascending expert order, like the reference, so float sums accumulate in the same order
        for e, count in enumerate(counts):
            if count == 0:
                continue
            tokens, slots = token_of[start : start + count], slot_of[start : start + count]
            start += count
            gate, up = self._gate_up(x[tokens], e).chunk(2, dim=-1)
            h = F.silu(gate) * up
            if self.observer is not None:
                self.observer(self.first_expert + e, "gate_up", x[tokens])
                self.observer(self.first_expert + e, "down", h)
            y = self._down(h, e) * weights[tokens, slots, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def _can_gather(self, picks: int) -> bool:
        """Whether a compiled step runs the experts as gathered weights: plain weights, no observer, and at
        most GATHER_MAX_BYTES of them copied (small decode batches)."""
        if self.fp8_block is not None or self.is_int4 or self.observer is not None:
            return False
        return picks * (self.gate_up_proj[0].nbytes + self.down_proj[0].nbytes) <= GATHER_MAX_BYTES

    def _gathered(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts without data-dependent shapes (what a compiled graph can hold): each token's
        chosen experts' weights are gathered and applied as batched products. Slots are summed in ascending
        expert order, as the loop above does."""
        ids = expert_ids - self.first_expert
        mine = (ids >= 0) & (ids < self.num_experts)  # another rank's experts contribute nothing here
        ids, order = ids.clamp(0, self.num_experts - 1).sort(dim=-1)
        scale = weights.gather(1, order) * mine.gather(1, order)  # (N, K) float32
        gate_up = torch.einsum("nd,nkid->nki", x, self.gate_up_proj[ids])  # (N, K, 2I)
        gate, up = gate_up.chunk(2, dim=-1)
        y = (torch.einsum("nki,nkdi->nkd", F.silu(gate) * up, self.down_proj[ids]) * scale[..., None]).to(x.dtype)
        out = y[:, 0]
        for k in range(1, y.shape[1]):
            out = out + y[:, k]
        return out


# Largest expert-weight copy one compiled step may gather (N tokens x K experts' weights); larger batches run
# the per-expert loop (the compiled graph breaks around it).
GATHER_MAX_BYTES = 64 << 20


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.gate = Router(config)  # replicated: every rank routes every token the same way
        self.experts = Experts(config, tp)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared // tp.size)
        self.last_router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, weights, expert_ids = self.gate(x)
        if self.training:
            self.last_router_logits = logits  # read by the RL trainer's balance/entropy losses
        out: torch.Tensor = self.experts(x, expert_ids, weights) + self.shared_experts(x)
        return out
