"""The small interface every DSA kernel backend implements (portable PyTorch, CUDA, Ascend)."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class AttentionOutput(NamedTuple):
    out: torch.Tensor  # (n, H, C) latent-space attention output; (n, H, V) from dense_mha
    entropy: torch.Tensor | None  # mean attention entropy in nats (a 0-d float32 tensor), when asked for


class DSAKernels(Protocol):
    name: str

    def index_scores(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float
    ) -> torch.Tensor: ...

    def index_scores_flat(
        self, keys: torch.Tensor, key_scale: torch.Tensor | None, q: torch.Tensor, weights: torch.Tensor, scale: float
    ) -> torch.Tensor: ...

    def topk(self, scores: torch.Tensor, k: int, ordered: bool = True) -> tuple[torch.Tensor, torch.Tensor]: ...

    def sparse_mla(
        self,
        q_lat: torch.Tensor,
        q_rope: torch.Tensor,
        kv: torch.Tensor,
        valid: torch.Tensor,
        scale: float,
        want_entropy: bool = False,
    ) -> AttentionOutput: ...

    def dense_mla(
        self,
        q_lat: torch.Tensor,
        q_rope: torch.Tensor,
        kv: torch.Tensor,
        valid: torch.Tensor,
        scale: float,
        want_entropy: bool = False,
    ) -> AttentionOutput: ...

    def dense_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor,
        scale: float,
        want_entropy: bool = False,
    ) -> AttentionOutput: ...
