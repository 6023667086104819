"""Guards that keep a sparse-attention MoE model's RL training from collapsing (source material 4.1 and 4.6):
non-finite gradients zeroed per parameter and counted with its name, adaptive gradient clipping, an MoE
expert-balance loss and a router-entropy regulariser."""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from glm5_trainer.distributed import full_norm, local

log = logging.getLogger(__name__)


def zero_nonfinite_grads(model: nn.Module, counts: Counter[str]) -> int:
    """Zero each parameter's gradient that holds NaN/Inf; returns how many were zeroed (counted by name). With
    sharded gradients every rank zeroes the same parameters: a NaN in any rank's shard zeroes the whole one."""
    named = [(name, p, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    bad = torch.tensor([not torch.isfinite(local(g)).all() for _, _, g in named], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1 and bad.numel():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    zeroed = 0
    for (name, _, grad), nonfinite in zip(named, bad.tolist(), strict=True):
        if nonfinite:
            grad.zero_()
            counts[name] += 1
            zeroed += 1
            log.warning("non-finite gradient in %s zeroed (%d times so far)", name, counts[name])
    return zeroed


@torch.no_grad()
def adaptive_clip(model: nn.Module, clip_factor: float = 0.85, eps: float = 1e-3) -> int:
    """Adaptive gradient clipping (Brock et al. 2021), per parameter tensor: the gradient norm may not exceed
    clip_factor * max(|w|, eps). Returns how many tensors were clipped. Norms are of whole tensors, also where
    each rank holds a shard (the same decision on every rank)."""
    clipped = 0
    for p in model.parameters():
        if p.grad is None:
            continue
        w_norm = full_norm(p.detach()).clamp(min=eps)
        g_norm = full_norm(p.grad)
        limit = clip_factor * w_norm
        if g_norm > limit:
            p.grad.mul_(float(limit / (g_norm + 1e-12)))
            clipped += 1
    return clipped


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def expert_balance_loss(router_probs: torch.Tensor, topk_idx: torch.Tensor, weight: float = 0.02,
                        counts: torch.Tensor | None = None, tokens: int | None = None) -> torch.Tensor:  # fmt: skip
    """Switch-style load balance: E * sum_e f_e * P_e, f_e = share of routed slots that went to expert e,
    P_e = mean router probability of e. (T, E) probabilities, (T, k) chosen experts. A rank training on part of
    a batch passes the whole batch's expert `counts` and `tokens`: its term is then its share of the batch's
    (linear in its probabilities), and the shares sum to the whole batch's loss."""
    num_experts = router_probs.shape[-1]
    if counts is None:
        counts = torch.bincount(topk_idx.flatten(), minlength=num_experts)
    probs = _at_least_float32(router_probs)
    f = counts.to(probs.dtype) / counts.sum().clamp(min=1)
    p = probs.sum(dim=0) / (router_probs.shape[0] if tokens is None else tokens)
    return weight * num_experts * (f.detach() * p).sum()


def router_entropy_loss(router_probs: torch.Tensor, weight: float = 0.005, tokens: int | None = None) -> torch.Tensor:
    """Minus the mean entropy of the normalised routing distribution: discourages collapse onto few experts.
    `tokens`: the whole batch's count, for a rank's share of it."""
    probs = _at_least_float32(router_probs)
    p = probs / probs.sum(dim=-1, keepdim=True).clamp(min=1e-12)
    entropy = -(p * p.clamp(min=1e-12).log()).sum(dim=-1).sum() / (router_probs.shape[0] if tokens is None else tokens)
    return -weight * entropy
