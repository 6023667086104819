"""Guards that keep a sparse-attention MoE model's RL training from collapsing (source material 4.1 and 4.6):
non-finite gradients zeroed per parameter and counted with its name, adaptive gradient clipping, an MoE
expert-balance loss and a router-entropy regulariser."""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

log = logging.getLogger(__name__)


def zero_nonfinite_grads(model: nn.Module, counts: Counter[str]) -> int:
    """Zero each parameter's gradient that holds NaN/Inf; returns how many were zeroed (counted by name)."""
    zeroed = 0
    for name, p in model.named_parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            p.grad.zero_()
            counts[name] += 1
            zeroed += 1
            log.warning("non-finite gradient in %s zeroed (%d times so far)", name, counts[name])
    return zeroed


@torch.no_grad()
def adaptive_clip(model: nn.Module, clip_factor: float = 0.85, eps: float = 1e-3) -> int:
    """Adaptive gradient clipping (Brock et al. 2021), per parameter tensor: the gradient norm may not exceed
    clip_factor * max(|w|, eps). Returns how many tensors were clipped."""
    clipped = 0
    for p in model.parameters():
        if p.grad is None:
            continue
        w_norm = p.detach().norm().clamp(min=eps)
        g_norm = p.grad.norm()
        limit = clip_factor * w_norm
        if g_norm > limit:
            p.grad.mul_(limit / (g_norm + 1e-12))
            clipped += 1
    return clipped


def expert_balance_loss(router_probs: torch.Tensor, topk_idx: torch.Tensor, weight: float = 0.02) -> torch.Tensor:
    """Switch-style load balance: E * sum_e f_e * P_e, f_e = share of routed slots that went to expert e,
    P_e = mean router probability of e. (T, E) probabilities, (T, k) chosen experts."""
    num_experts = router_probs.shape[-1]
    f = torch.bincount(topk_idx.flatten(), minlength=num_experts).float() / topk_idx.numel()
    p = router_probs.float().mean(dim=0)
    return weight * num_experts * (f.detach() * p).sum()


def router_entropy_loss(router_probs: torch.Tensor, weight: float = 0.005) -> torch.Tensor:
    """Minus the mean entropy of the normalised routing distribution: discourages collapse onto few experts."""
    p = router_probs.float() / router_probs.float().sum(dim=-1, keepdim=True).clamp(min=1e-12)
    entropy = -(p * p.clamp(min=1e-12).log()).sum(dim=-1).mean()
    return -weight * entropy
