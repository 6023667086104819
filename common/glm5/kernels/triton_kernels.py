# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (@triton.jit kernels: pointer and constexpr parameters are typed by Triton, not by Python annotations)
"""Triton kernels for the DSA decode hot path (CUDA; any device Triton targets).

Two fused kernels replace chains of PyTorch ops that each read their input from memory again:

- `index_scores_flat`: lightning-indexer scores of one query against a run of cached keys, read in place:
  per block of keys, the per-head dot products, scale, ReLU and head-weighted sum happen in registers, and
  INT8 (L2 tier) keys are dequantised on load instead of being converted to a float copy first. One float per
  key is written.
- `sparse_mla`: attention of each decode query over its own gathered top-k latents (absorbed MLA form) in one
  pass with an online softmax (flash-decoding style): the (heads x k) score matrix never reaches memory.

Both compute in float32 (inputs upcast on load; dot products at IEEE precision, not TF32): decode is
bandwidth-bound, and float32 keeps them within rounding of the portable backend, which remains the reference
(tests/unit/kernels). Everything else (batched/prefill scoring, dense attention) is the portable backend's.
The kernels run under Triton's CPU interpreter too (TRITON_INTERPRET=1), which is how they are tested on
machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5.kernels.base import AttentionOutput
from glm5.kernels.portable import PortableKernels

# tl.dot wants every block dimension >= 16
_MIN_BLOCK = 16


def _block(n: int) -> int:
    return max(_MIN_BLOCK, int(triton.next_power_of_2(n)))


@triton.jit
def _index_flat_kernel(
    keys_ptr, key_scale_ptr, q_ptr, w_ptr, out_ptr, T, stride_key, HI, DI, scale,
    HAS_SCALE: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    h = tl.arange(0, BH)
    in_rows = rows < T
    keys = tl.load(keys_ptr + rows[:, None] * stride_key + d[None, :], mask=in_rows[:, None] & (d[None, :] < DI),
                   other=0).to(tl.float32)  # fmt: skip
    q = tl.load(q_ptr + h[:, None] * DI + d[None, :], mask=(h[:, None] < HI) & (d[None, :] < DI),
                other=0).to(tl.float32)  # fmt: skip
    s = tl.dot(keys, tl.trans(q), input_precision="ieee")  # (BT, BH)
    s = tl.maximum(s * scale, 0.0)
    w = tl.load(w_ptr + h, mask=h < HI, other=0).to(tl.float32)
    out = tl.sum(s * w[None, :], axis=1)
    if HAS_SCALE:  # INT8 keys: relu(s * x) = s * relu(x) for the positive per-key scale
        out = out * tl.load(key_scale_ptr + rows, mask=in_rows, other=0).to(tl.float32)
    tl.store(out_ptr + rows, out, mask=in_rows)


@triton.jit
def _sparse_mla_kernel(
    q_lat_ptr, q_rope_ptr, kv_ptr, valid_ptr, out_ptr, H, K, C, R, scale,
    s_ql0, s_ql1, s_qr0, s_qr1, s_kv0, s_kv1, s_v0, s_o0, s_o1,
    BH: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    c = tl.arange(0, BC)
    r = tl.arange(0, BR)
    hm = h < H
    q_lat = tl.load(q_lat_ptr + i * s_ql0 + h[:, None] * s_ql1 + c[None, :], mask=hm[:, None] & (c[None, :] < C),
                    other=0).to(tl.float32) * scale  # fmt: skip
    q_rope = tl.load(q_rope_ptr + i * s_qr0 + h[:, None] * s_qr1 + r[None, :], mask=hm[:, None] & (r[None, :] < R),
                     other=0).to(tl.float32) * scale  # fmt: skip
    m = tl.full([BH], float("-inf"), tl.float32)
    denom = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BC], tl.float32)
    for start in range(0, K, BK):
        j = start + tl.arange(0, BK)
        jm = j < K
        ok = tl.load(valid_ptr + i * s_v0 + j, mask=jm, other=0) != 0
        row = kv_ptr + i * s_kv0 + j[:, None] * s_kv1
        lat = tl.load(row + c[None, :], mask=jm[:, None] & (c[None, :] < C), other=0).to(tl.float32)  # (BK, BC)
        rope = tl.load(row + C + r[None, :], mask=jm[:, None] & (r[None, :] < R), other=0).to(tl.float32)
        s = tl.dot(q_lat, tl.trans(lat), input_precision="ieee") + tl.dot(q_rope, tl.trans(rope),
                                                                          input_precision="ieee")  # fmt: skip
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # a row with nothing valid yet keeps a finite reference, so exp() gives 0 instead of NaN
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - ref[:, None])
        alpha = tl.exp(m - ref)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision="ieee")
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + i * s_o0 + h[:, None] * s_o1 + c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & (c[None, :] < C))  # fmt: skip


class TritonKernels(PortableKernels):
    """Fused decode kernels; the rest inherited from the portable backend."""

    name = "triton"
    INDEX_BLOCK = 64
    HEAD_BLOCK = 16
    KEY_BLOCK = 16

    def index_scores_flat(
        self, keys: torch.Tensor, key_scale: torch.Tensor | None, q: torch.Tensor, weights: torch.Tensor, scale: float
    ) -> torch.Tensor:
        t, dim = keys.shape
        heads = q.shape[0]
        if keys.stride(1) != 1:
            keys = keys.contiguous()
        q = q.contiguous()
        w = weights.float().contiguous()
        out = torch.empty(t, dtype=torch.float32, device=keys.device)
        has_scale = keys.dtype == torch.int8
        if has_scale:
            assert key_scale is not None, "INT8 keys need their scales"
            ks = key_scale.reshape(-1).contiguous()
        else:
            ks = w  # unused
        grid = (triton.cdiv(t, self.INDEX_BLOCK),)
        _index_flat_kernel[grid](
            keys, ks, q, w, out, t, keys.stride(0), heads, dim, float(scale),
            HAS_SCALE=has_scale, BT=self.INDEX_BLOCK, BH=_block(heads), BD=_block(dim),
        )  # fmt: skip
        return out

    def topk(self, scores: torch.Tensor, k: int, ordered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        # the portable threshold top-k trades a host round trip (nonzero) for less sorting: a loss on a GPU
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
        if want_entropy:  # the entropy metric needs every probability: the portable path keeps them
            return super().sparse_mla(q_lat, q_rope, kv, valid, scale, want_entropy)
        n, heads, c = q_lat.shape
        k, r = kv.shape[1], q_rope.shape[-1]
        q_lat, q_rope = q_lat.contiguous(), q_rope.contiguous()
        if kv.stride(-1) != 1:
            kv = kv.contiguous()
        valid = valid.contiguous()
        out = torch.empty(n, heads, c, dtype=q_lat.dtype, device=q_lat.device)
        grid = (n, triton.cdiv(heads, self.HEAD_BLOCK))
        _sparse_mla_kernel[grid](
            q_lat, q_rope, kv, valid.view(torch.int8), out, heads, k, c, r, float(scale),
            q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), kv.stride(0), kv.stride(1),
            valid.stride(0), out.stride(0), out.stride(1),
            BH=self.HEAD_BLOCK, BK=self.KEY_BLOCK, BC=_block(c), BR=_block(r), num_warps=8,
        )  # fmt: skip
        return AttentionOutput(out, None)
