"""Portable PyTorch kernels for DSA: lightning-indexer scoring, top-k and MLA attention in absorbed form.

They run on any device torch supports and are the reference the device-specific kernels are tested against.
Shapes: n queries, H attention heads, C = kv_lora_rank, R = rope dim, Hi/Di indexer heads/dim, T context.
"""

from __future__ import annotations

import torch

from glm5.kernels.base import AttentionOutput


class PortableKernels:
    name = "portable"

    def index_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
        """Lightning indexer (DeepSeek-V3.2, eq. 1): I[t, s] = sum_h w[t, h] * relu(scale * q[t, h] . k[s]).

        q (B, n, Hi, Di) float32, weights (B, n, Hi) float32, keys (B, T, Di) -> (B, n, T) float32.
        The op order (scale, relu, weighted sum) is transformers' so top-k sets match it exactly.
        """
        scores = torch.matmul(q, keys.transpose(-1, -2).unsqueeze(1)) * scale  # (B, n, Hi, T)
        scores = torch.relu(scores)
        return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # (B, n, T)

    def topk(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., T) -> indices (..., k) sorted by score descending, and valid (..., k): score > -inf."""
        values, idx = scores.topk(k, dim=-1, sorted=True)
        return idx, values > float("-inf")

    def sparse_mla(
        self,
        q_lat: torch.Tensor,
        q_rope: torch.Tensor,
        kv: torch.Tensor,
        valid: torch.Tensor,
        scale: float,
        want_entropy: bool = False,
    ) -> AttentionOutput:
        """Attention of each query over its own gathered tokens, in MLA's absorbed form.

        q_lat (n, H, C) = q_nope @ W_uk, q_rope (n, H, R), kv (n, k, C + R) gathered latents + rope keys,
        valid (n, k) -> latent output (n, H, C) (to be multiplied by W_uv).
        """
        c = q_lat.shape[-1]
        latent = kv[..., :c]  # (n, k, C)
        scores = torch.matmul(q_lat, latent.transpose(1, 2))  # (n, H, k)
        scores = scores + torch.matmul(q_rope, kv[..., c:].transpose(1, 2))
        scores = (scores * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
        out = torch.matmul(probs, latent)  # (n, H, C)
        return AttentionOutput(out, _entropy(probs) if want_entropy else None)

    def dense_mla(
        self,
        q_lat: torch.Tensor,
        q_rope: torch.Tensor,
        kv: torch.Tensor,
        valid: torch.Tensor,
        scale: float,
        want_entropy: bool = False,
    ) -> AttentionOutput:
        """All queries over one shared context: kv (T, C + R), valid (n, T) (causal mask) -> (n, H, C)."""
        c = q_lat.shape[-1]
        latent = kv[:, :c]
        scores = torch.matmul(q_lat, latent.T) + torch.matmul(q_rope, kv[:, c:].T)  # (n, H, T)
        scores = (scores * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
        return AttentionOutput(torch.matmul(probs, latent), _entropy(probs) if want_entropy else None)


def _entropy(probs: torch.Tensor) -> float:
    """Mean over queries and heads of -sum p log p (nats)."""
    p = probs.float()
    return float(-(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean())
