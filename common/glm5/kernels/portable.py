"""Portable PyTorch kernels for DSA: lightning-indexer scoring, top-k and MLA attention in absorbed form.

They run on any device torch supports and are the reference the device-specific kernels are tested against.
Shapes: n queries, H attention heads, C = kv_lora_rank, R = rope dim, Hi/Di indexer heads/dim, T context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.kernels.base import AttentionOutput


class PortableKernels:
    """Not thread-safe: scratch buffers are reused across calls (one engine thread owns an instance)."""

    name = "portable"

    def __init__(self) -> None:
        self._scratch: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reusable scratch tensor of at least `shape` (grown, never shrunk)."""
        key = (name, dtype, device)
        numel = 1
        for s in shape:
            numel *= s
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[key] = buf
        return buf[:numel].view(shape)

    def index_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
        """Lightning indexer (DeepSeek-V3.2, eq. 1): I[t, s] = sum_h w[t, h] * relu(scale * q[t, h] . k[s]).

        q (B, n, Hi, Di) float32, weights (B, n, Hi) float32, keys (B, T, Di) -> (B, n, T) float32.
        The op order (scale, relu, weighted sum) is transformers' so top-k sets match it exactly.
        """
        b, n, heads, dim = q.shape
        if torch.compiler.is_compiling() and b * n == 1:
            # one decode query in a compiled step: generated loops, fused with the relu and the weighted sum
            scores = (q[:, :, :, None, :] * keys[:, None, None]).sum(-1).mul_(scale).relu_()  # (1, 1, Hi, T)
            return (weights[..., None] * scores).sum(2)
        if b == 1:  # one context for all queries (prefill): a single GEMM
            scores = (q.reshape(n * heads, dim) @ keys[0].T).view(1, n, heads, -1)  # (1, n, Hi, T)
        else:
            scores = torch.matmul(q, keys.transpose(-1, -2).unsqueeze(1))  # (B, n, Hi, T)
        scores.mul_(scale).relu_()
        return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # (B, n, T)

    def index_scores_flat(
        self, keys: torch.Tensor, key_scale: torch.Tensor | None, q: torch.Tensor, weights: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """One query against a contiguous run of cached keys, read in place (no gather).

        keys (T, Di) in the cache dtype (INT8 with key_scale (T, 1) for the L2 tier), q (Hi, Di), weights
        (Hi,) -> (T,) float32. Scores are computed in the cache dtype (fp32 accumulation inside the GEMMs,
        one rounding of each per-head score and of the weighted sum to that dtype); relu(s * x) = s * relu(x)
        for the positive per-head and per-key scales. In a float32 cache everything stays float32.
        """
        t, dev = keys.shape[0], keys.device
        is_int8 = keys.dtype == torch.int8
        dtype = q.dtype if is_int8 else keys.dtype
        q_t = q.to(dtype).T.contiguous()  # (Di, Hi)
        w = (weights.float() * scale).to(dtype)
        heads = q.shape[0]
        out = torch.empty(t, dtype=dtype, device=dev)
        # chunks small enough that the (chunk, Hi) intermediate stays in cache between the three passes
        chunk = min(t, _SCORE_CHUNK)
        scratch = self._buffer("scores", (chunk, heads), dtype, dev)
        for s in range(0, t, chunk):
            e = min(t, s + chunk)
            part = keys[s:e].to(dtype) if is_int8 else keys[s:e]
            torch.mm(part, q_t, out=scratch[: e - s]).relu_()
            torch.mv(scratch[: e - s], w, out=out[s:e])
        out = out.float()
        if is_int8:
            assert key_scale is not None
            out.mul_(key_scale[:, 0].float())
        return out

    def topk(self, scores: torch.Tensor, k: int, ordered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., T) -> indices (..., k) and valid (..., k) (score > -inf); sorted by score when `ordered`."""
        if scores.dim() == 2 and scores.shape[-1] >= _THRESHOLD_MIN_T and k * 4 <= scores.shape[-1]:
            rows = [_threshold_topk(row, k, ordered) for row in scores]
            return torch.stack([r[1] for r in rows]), torch.stack([r[0] for r in rows]) > float("-inf")
        values, idx = scores.topk(k, dim=-1, sorted=ordered)
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
        q = torch.cat([q_lat, q_rope], dim=-1) * scale  # one product against [latent, rope key]
        scores = _bmm(q, kv.transpose(1, 2))  # (n, H, k)
        # a compiled step cannot branch on tensor values: it always masks (the same result)
        if torch.compiler.is_compiling() or not bool(valid.all()):
            scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
        probs = _softmax32(scores)
        out = _bmm(probs.to(q_lat.dtype), kv[..., :c])  # (n, H, C)
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
        n, h, c = q_lat.shape
        if not want_entropy and _fused_dense(q_lat, kv):
            # the latent is both key and value (its first C columns): one fused masked-softmax pass, no
            # (n, H, T) score matrix in memory
            q = torch.cat([q_lat, q_rope], dim=-1).transpose(0, 1).unsqueeze(0)  # (1, H, n, C + R)
            k = kv.expand(1, h, *kv.shape)
            out = F.scaled_dot_product_attention(q, k, k, attn_mask=valid[None, None], scale=scale)
            return AttentionOutput(out[0, :, :, :c].transpose(0, 1), None)
        q = (torch.cat([q_lat, q_rope], dim=-1) * scale).reshape(n * h, -1)
        scores = (q @ kv.T).view(n, h, -1)  # (n, H, T)
        if not bool(valid.all()):
            scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
        probs = _softmax32(scores)
        out = (probs.to(q_lat.dtype).view(n * h, -1) @ kv[:, :c]).view(n, h, c)
        return AttentionOutput(out, _entropy(probs) if want_entropy else None)

    def dense_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor,
        scale: float,
        want_entropy: bool = False,
    ) -> AttentionOutput:
        """Multi-head attention over one shared context (MLA's expanded form, for prefill): q (n, H, Dk),
        k (T, H, Dk), v (T, H, Dv), valid (n, T) -> (n, H, Dv). Every row needs a valid key."""
        qh = (q * scale).transpose(0, 1)  # (H, n, Dk)
        scores = _bmm(qh, k.permute(1, 2, 0))  # (H, n, T)
        if not bool(valid.all()):
            scores.masked_fill_(~valid, float("-inf"))
        probs = _softmax32(scores)
        out = _bmm(probs.to(v.dtype), v.transpose(0, 1))  # (H, n, Dv)
        return AttentionOutput(out.transpose(0, 1), _entropy(probs) if want_entropy else None)


_SCORE_CHUNK = 16384
# Fused dense attention (PyTorch's CPU flash kernel) pays off when the (n, H, T) score matrix costs more memory
# traffic than its products cost arithmetic: several queries over a narrow latent (2-2.5x at C + R = 80 with 64+
# queries); at GLM-5's 576 it is no faster, and for a single query it rereads the context once per head.
_FUSED_MIN_QUERIES = 16
_FUSED_MAX_DIM = 128


def _fused_dense(q_lat: torch.Tensor, kv: torch.Tensor) -> bool:
    return kv.device.type == "cpu" and q_lat.shape[0] >= _FUSED_MIN_QUERIES and kv.shape[-1] <= _FUSED_MAX_DIM


_LOOP_BMM_MAX = 64


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched matmul. On CPU, half-precision bmm misses oneDNN's fast path (~3x slower than the same
    products as 2-D matmuls), so small batches run as a loop of 2-D products there."""
    if a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16) and a.shape[0] <= _LOOP_BMM_MAX:
        return torch.stack([x @ y for x, y in zip(a, b, strict=True)])
    return torch.matmul(a, b)


_THRESHOLD_MIN_T = 16384
_SAMPLE = 4096


def _threshold_topk(row: torch.Tensor, k: int, ordered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of a long row: guess a threshold from a strided sample, keep what passes, top-k of that.

    Falls back to a full top-k when fewer than k pass, so the result is always exact.
    """
    n = row.shape[0]
    sample = row[:: max(1, n // _SAMPLE)]
    # keep ~1.5k candidates in expectation
    rank = max(1, sample.shape[0] - int(1.5 * k * sample.shape[0] / n))
    threshold = torch.kthvalue(sample, rank).values
    candidates = (row >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return row.topk(k, sorted=ordered)
    values, i = row[candidates].topk(k, sorted=ordered)
    return values, candidates[i]


def _softmax32(scores: torch.Tensor) -> torch.Tensor:
    """Softmax in float32 (no extra copy when the scores already are)."""
    if scores.dtype == torch.float32:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores, dim=-1, dtype=torch.float32)


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean over queries and heads of -sum p log p (nats), 0-d (a tensor: a compiled step cannot read it)."""
    p = probs.float()
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
