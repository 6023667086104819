"""Rotary position embeddings: default, linear and YaRN frequencies, and DeepSeek's interleaved rotation.

Frequencies are computed exactly as transformers 5.23 does (`modeling_rope_utils`), so cos/sin are bit-equal.
"""

from __future__ import annotations

import math

import torch

from glm5.model.config import RopeConfig, yarn_mscale


def inv_freq_and_scale(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (dim // 2,) and the factor cos/sin are multiplied by."""
    base = rope.rope_theta
    if rope.rope_type == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope.rope_type == "linear":
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
        return inv / rope.factor, 1.0
    return _yarn(rope, dim)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    # YaRN (arXiv:2309.00071): interpolate low frequencies, keep high ones, ramp in between.
    base, factor = rope.rope_theta, rope.factor
    assert rope.original_max_position_embeddings is not None
    original = rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x0, x1), (x2, x3), ... and returns them de-interleaved: [rotated evens, rotated odds].

    This is transformers' `apply_rotary_pos_emb_interleave`; queries and keys get the same permutation, so
    dot products are those of the interleaved layout. x (N, ..., dim); cos/sin (N, dim/2), broadcast over
    the middle axes.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
