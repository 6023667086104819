"""The portable kernels' fast paths against their plain definitions."""

from __future__ import annotations

import torch
from glm5.kernels import PortableKernels
from glm5.kvcache.storage import KVLayout, PagedKVStorage, quantize_rows

K = PortableKernels()


def test_threshold_topk_is_exact() -> None:
    g = torch.Generator().manual_seed(0)
    for t, k in ((20000, 2048), (70000, 2048), (30000, 5000)):
        scores = torch.randn(3, t, generator=g)
        scores[0, : t // 2] = float("-inf")  # a short sequence padded to the batch width
        scores[1] = torch.linspace(-1, 1, t)  # sorted input: a strided sample is maximally unrepresentative
        idx, valid = K.topk(scores, k)
        ref_values, ref_idx = scores.topk(k, dim=-1)
        for r in range(3):
            assert set(idx[r].tolist()) == set(ref_idx[r].tolist())
            assert torch.equal(scores[r, idx[r]], ref_values[r])
        assert valid.all()


def test_flat_index_scores_match_the_reference_order() -> None:
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(3000, 64, generator=g)
    q, w = torch.randn(8, 64, generator=g), torch.randn(8, generator=g)
    ref = K.index_scores(q[None, None], w[None, None], keys[None], 0.125)[0, 0]
    assert torch.allclose(K.index_scores_flat(keys, None, q, w, 0.125), ref, atol=1e-4, rtol=1e-5)
    qk, scale = quantize_rows(keys)
    deq = qk.float() * scale.float()
    ref_q = K.index_scores(q[None, None], w[None, None], deq[None], 0.125)[0, 0]
    got = K.index_scores_flat(qk, scale, q, w, 0.125)
    assert torch.allclose(got, ref_q, atol=1e-3, rtol=1e-4)


def test_bfloat16_keys_score_within_rounding_and_keep_the_top_k() -> None:
    """A float32 query against bfloat16 keys (--kv-index-dtype bfloat16) is scored in bfloat16: scores move by
    about bfloat16's rounding, so only near-ties change places in the top-k."""
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(8192, 128, generator=g)
    q, w = torch.randn(32, 128, generator=g), torch.rand(32, generator=g)
    ref = K.index_scores_flat(keys, None, q, w, 128**-0.5)
    got = K.index_scores_flat(keys.bfloat16(), None, q, w, 128**-0.5)
    assert got.dtype == torch.float32
    assert float((got - ref).abs().max()) < 0.02 * float(ref.abs().max())
    k = 512
    overlap = len(set(ref.topk(k).indices.tolist()) & set(got.topk(k).indices.tolist())) / k
    assert overlap > 0.9


def test_runs_split_at_gaps_and_at_the_tier_boundary() -> None:
    layout = KVLayout(1, 8, 4, 8, (0,), 4, 4, 4, torch.float32, torch.device("cpu"))
    st = PagedKVStorage(layout)
    assert st.runs([0, 1, 2, 3, 4, 5], 22) == [(0, 16), (4, 6)]
    assert st.runs([5, 6, 2, 3], 13) == [(5, 8), (2, 5)]
    keys, scale = st.index_run(0, 5, 8)
    assert keys.dtype == torch.int8 and keys.shape == (8, 8) and scale is not None
    assert keys.data_ptr() == st.q_index[0, 4:].data_ptr()  # a view, not a copy


def _dense_reference(
    q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked softmax attention in float64, the latent as key (with the rope key) and as value."""
    c = q_lat.shape[-1]
    q = torch.cat([q_lat, q_rope], -1).double() * scale
    scores = torch.einsum("nhd,td->nht", q, kv.double()).masked_fill(~valid[:, None], float("-inf"))
    return torch.einsum("nht,tc->nhc", scores.softmax(-1), kv[:, :c].double())


def test_dense_attention_matches_the_reference_on_both_paths() -> None:
    g = torch.Generator().manual_seed(0)
    k = PortableKernels()
    for n, width in ((40, 64 + 16), (40, 256 + 32), (3, 64 + 16)):  # fused (many queries, narrow), unfused x2
        t, h, c = 200, 4, width - 16 if width < 128 else width - 32
        q_lat, q_rope = torch.randn(n, h, c, generator=g), torch.randn(n, h, width - c, generator=g)
        kv = torch.randn(t, width, generator=g)
        qpos = torch.arange(t - n, t)
        valid = (torch.arange(t)[None] <= qpos[:, None]) & (torch.rand(n, t, generator=g) < 0.4)
        valid[torch.arange(n), qpos] = True
        ref = _dense_reference(q_lat, q_rope, kv, valid, 0.1)
        for want_entropy in (False, True):
            got = k.dense_mla(q_lat, q_rope, kv, valid, 0.1, want_entropy)
            assert got.out.shape == (n, h, c)
            assert torch.allclose(got.out.double(), ref, atol=1e-5), (n, width, want_entropy)
            assert (got.entropy is not None) == want_entropy


def test_expanded_attention_matches_the_reference() -> None:
    """dense_mha (MLA's expanded form, per-head keys and values) against masked softmax attention in float64,
    with key and value widths that differ as MLA's do (nope + rope vs v)."""
    g = torch.Generator().manual_seed(1)
    n, t, h, dk, dv = 24, 90, 4, 48, 32
    q, k = torch.randn(n, h, dk, generator=g), torch.randn(t, h, dk, generator=g)
    v = torch.randn(t, h, dv, generator=g)
    qpos = torch.arange(t - n, t)
    valid = (torch.arange(t)[None] <= qpos[:, None]) & (torch.rand(n, t, generator=g) < 0.5)
    valid[torch.arange(n), qpos] = True
    scores = torch.einsum("nhd,thd->nht", q.double() * 0.2, k.double()).masked_fill(~valid[:, None], float("-inf"))
    probs = scores.softmax(-1)
    ref = torch.einsum("nht,thv->nhv", probs, v.double())
    ref_entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()
    for want_entropy in (False, True):
        got = K.dense_mha(q, k, v, valid, 0.2, want_entropy)
        assert got.out.shape == (n, h, dv)
        assert torch.allclose(got.out.double(), ref, atol=1e-5)
        assert (got.entropy is None) != want_entropy
        if got.entropy is not None:
            assert abs(float(got.entropy) - float(ref_entropy)) < 1e-5
    # half precision on the CPU takes the loop of 2-D products: the same result within bfloat16's precision
    got16 = K.dense_mha(q.bfloat16(), k.bfloat16(), v.bfloat16(), valid, 0.2).out
    assert got16.dtype == torch.bfloat16
    assert (got16.double() - ref).abs().max() < 0.05
