"""GRPO-style advantages and the double-sided importance-sampling policy loss (GLM-5 report).

For every model token: r = exp(logp_theta - logp_rollout). Tokens whose r falls outside
(1 - eps_low, 1 + eps_high) are masked out of the gradient (the trust region); inside it the token
contributes -sg(r) * A * logp_theta, whose gradient equals that of -r * A with the weight detached.
Presets: math (0.15, 0.35), terminal (0.05, 0.25); explicit values override. An optional IcePop-style gate
additionally drops tokens whose engine/trainer mismatch ratio leaves [gate_low, gate_high].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PRESETS: dict[str, tuple[float, float]] = {"math": (0.15, 0.35), "terminal": (0.05, 0.25)}


@dataclass(frozen=True, slots=True)
class TrustRegion:
    eps_low: float
    eps_high: float
    gate: tuple[float, float] | None = None  # IcePop: keep tokens with mismatch ratio in [low, high]

    def __post_init__(self) -> None:
        if not 0 < self.eps_low < 1 or self.eps_high <= 0:
            raise ValueError(f"need 0 < eps_low < 1 and eps_high > 0, got {self.eps_low}, {self.eps_high}")
        if self.gate is not None and not 0 < self.gate[0] < 1 < self.gate[1]:
            raise ValueError(f"the IcePop gate needs 0 < low < 1 < high, got {self.gate}")

    @classmethod
    def preset(cls, name: str, eps_low: float | None = None, eps_high: float | None = None,
               gate: tuple[float, float] | None = None) -> TrustRegion:  # fmt: skip
        if name not in PRESETS and (eps_low is None or eps_high is None):
            raise ValueError(f"preset {name!r} needs explicit eps_low and eps_high (presets: {sorted(PRESETS)})")
        low, high = PRESETS.get(name, (eps_low, eps_high))
        return cls(eps_low if eps_low is not None else low, eps_high if eps_high is not None else high, gate)  # type: ignore[arg-type]


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(N,) rewards and group ids -> (reward - group mean) / (group std + eps); a group whose rewards are all
    equal gets zero advantage (nothing to learn from it)."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(groups):
        idx = groups == g
        r = rewards[idx].float()
        std = r.std(unbiased=False) if r.numel() > 1 else r.new_zeros(())
        adv[idx] = (r - r.mean()) / (std + eps)
    return adv


@dataclass(frozen=True, slots=True)
class LossStats:
    loss: torch.Tensor
    kept: int  # model tokens inside the trust region (and the gate)
    clipped_low: int
    clipped_high: int
    gated: int


def policy_loss(
    logp: torch.Tensor,  # (N, T) log-probs of the taken tokens under the current weights (with grad)
    logp_rollout: torch.Tensor,  # (N, T) the engine's log-probs when it sampled them
    advantages: torch.Tensor,  # (N,)
    mask: torch.Tensor,  # (N, T) 1 for model tokens
    region: TrustRegion,
    logp_engine_same_weights: torch.Tensor | None = None,  # (N, T) for the IcePop gate
    tokens: int | None = None,  # the whole batch's model tokens, where these rows are one rank's part of it
) -> LossStats:
    mask = mask.bool()
    ratio = torch.exp(logp.detach() - logp_rollout)
    low, high = ratio < 1 - region.eps_low, ratio > 1 + region.eps_high
    keep = mask & ~low & ~high
    gated = torch.zeros_like(keep)
    if region.gate is not None and logp_engine_same_weights is not None:
        mismatch = torch.exp(logp.detach() - logp_engine_same_weights)
        gated = keep & ((mismatch < region.gate[0]) | (mismatch > region.gate[1]))
        keep = keep & ~gated
    per_token = -(ratio * advantages[:, None] * logp)  # ratio carries no gradient: the weight is detached
    # normalise by all model tokens (masking does not inflate the others), the whole batch's on a rank
    denom = mask.sum().clamp(min=1) if tokens is None else max(tokens, 1)
    loss = (per_token * keep).sum() / denom
    return LossStats(loss, int(keep.sum()), int((mask & low).sum()), int((mask & high).sum()), int(gated.sum()))
