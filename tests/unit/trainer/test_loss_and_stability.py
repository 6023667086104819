"""The double-sided importance-sampling loss, group advantages and the stability guards."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from glm5_trainer.loss import PRESETS, TrustRegion, group_advantages, policy_loss
from glm5_trainer.stability import adaptive_clip, expert_balance_loss, router_entropy_loss, zero_nonfinite_grads
from torch import nn


def test_presets_and_overrides() -> None:
    assert (TrustRegion.preset("math").eps_low, TrustRegion.preset("math").eps_high) == PRESETS["math"] == (0.15, 0.35)
    assert TrustRegion.preset("terminal", eps_high=0.3) == TrustRegion(0.05, 0.3)
    with pytest.raises(ValueError, match="explicit"):
        TrustRegion.preset("custom", eps_low=0.1)
    with pytest.raises(ValueError):
        TrustRegion(1.2, 0.3)


def test_group_advantages() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 5.0]), torch.tensor([0, 0, 0, 0, 1, 1]))
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4)
    assert torch.equal(adv[4:], torch.zeros(2))  # all equal: nothing to learn


def test_tokens_outside_the_trust_region_get_no_gradient() -> None:
    logp_rollout = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    # ratios 1.0, 0.8 (< 1 - 0.15), 1.3 (inside 1 + 0.35), 1.5 (> 1 + 0.35)
    theta = torch.log(torch.tensor([[0.5, 0.4, 0.65, 0.75]])).requires_grad_(True)
    stats = policy_loss(theta, logp_rollout, torch.tensor([2.0]), torch.ones(1, 4), TrustRegion.preset("math"))
    stats.loss.backward()
    grad = theta.grad
    assert grad is not None
    assert (stats.kept, stats.clipped_low, stats.clipped_high) == (2, 1, 1)
    assert grad[0, 1] == 0 and grad[0, 3] == 0  # masked out of the gradient
    # inside: d/dlogp of -(sg(r) * A * logp) / n_model_tokens = -r * A / 4
    assert torch.allclose(grad[0, [0, 2]], torch.tensor([-1.0 * 2 / 4, -1.3 * 2 / 4]), atol=1e-5)
    # the weight is detached: the same gradient as -r * A, whose d/dlogp is -r * A
    theta2 = theta.detach().clone().requires_grad_(True)
    (-(torch.exp(theta2 - logp_rollout)[0, [0, 2]] * 2).sum() / 4).backward()
    assert torch.allclose(grad[0, [0, 2]], theta2.grad[0, [0, 2]], atol=1e-5)  # type: ignore[index]


def test_prompt_tokens_and_icepop_gate() -> None:
    logp_rollout = torch.zeros(1, 3)
    theta = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    engine = torch.tensor([[0.0, 0.0, -1.0]])  # token 2: the engine under the same weights disagrees a lot
    region = TrustRegion(0.2, 0.2, gate=(0.5, 2.0))
    stats = policy_loss(theta, logp_rollout, torch.tensor([1.0]), mask, region, engine)
    stats.loss.backward()
    assert (stats.kept, stats.gated) == (1, 1) and theta.grad is not None
    assert theta.grad[0, 0] == 0 and theta.grad[0, 2] == 0 and theta.grad[0, 1] != 0


def test_nonfinite_grads_zeroed_by_name_and_adaptive_clip() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    model[0].weight.grad[0, 0] = float("nan")  # type: ignore[index]
    counts: Counter[str] = Counter()
    assert zero_nonfinite_grads(model, counts) == 1 and counts == Counter({"0.weight": 1})
    assert torch.equal(model[0].weight.grad, torch.zeros(4, 4))  # type: ignore[arg-type]
    model[1].weight.grad = torch.full_like(model[1].weight, 100.0)
    assert adaptive_clip(model, clip_factor=0.1) >= 1
    assert model[1].weight.grad.norm() <= 0.1 * model[1].weight.norm() + 1e-5  # type: ignore[union-attr]


def test_balance_and_entropy_losses_prefer_spread_routing() -> None:
    t, e = 64, 8
    uniform = torch.full((t, e), 1 / e)
    collapsed = torch.zeros(t, e)
    collapsed[:, 0] = 1.0
    spread_idx = torch.arange(t)[:, None] % e
    one_idx = torch.zeros(t, 1, dtype=torch.long)
    assert expert_balance_loss(uniform, spread_idx) < expert_balance_loss(collapsed, one_idx)
    assert expert_balance_loss(uniform, spread_idx).item() == pytest.approx(0.02)  # E * sum(1/E * 1/E) * 0.02
    assert router_entropy_loss(uniform) < router_entropy_loss(collapsed)  # more entropy, lower loss
    probs = torch.rand(t, e, requires_grad=True)
    (expert_balance_loss(probs.softmax(-1), spread_idx) + router_entropy_loss(probs.softmax(-1))).backward()
    assert probs.grad is not None and torch.isfinite(probs.grad).all()
