"""The Triton DSA kernels against a float32 reference and the portable backend.

Without a GPU they run under Triton's CPU interpreter (TRITON_INTERPRET=1): the same kernel code, executed
with NumPy, so a wrong index, mask or softmax fails here. On a CUDA machine the same checks run compiled
(tests/unit/kvcache/test_kernels_on_device.py). Skipped where the triton package is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from glm5.kernels import DSAKernels, PortableKernels, kernels_for
from glm5.tokenizer.build import write_tokenizer
from glm5_worker.config import EngineConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams

from tests.helpers.oracle import hf_checkpoint

pytest.importorskip("triton", reason="the triton package is not installed")


@pytest.fixture(scope="module")
def dev() -> str:
    """Where the kernels run: compiled on a GPU, else under Triton's CPU interpreter (tests/conftest.py sets
    TRITON_INTERPRET=1 before anything imports Triton)."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton was not put in interpreter mode")
    return "cpu"


@pytest.fixture(scope="module")
def triton_kernels(dev: str) -> DSAKernels:
    kernels = kernels_for(torch.device(dev), "triton")
    assert kernels.name == "triton"
    return kernels


def _scores_ref(keys: torch.Tensor, q: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    return ((keys.float() @ q.float().T) * scale).relu() @ w.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1000, 32, 128), (37, 3, 24), (64, 16, 16)])
def test_index_scores_flat_matches_reference(triton_kernels, dev, dtype, shape) -> None:
    t, heads, dim = shape
    g = torch.Generator().manual_seed(t)
    keys = torch.randn(t, dim, generator=g).to(dtype)
    q, w = torch.randn(heads, dim, generator=g).to(dtype), torch.randn(heads, generator=g)
    got = triton_kernels.index_scores_flat(keys.to(dev), None, q.to(dev), w.to(dev), 0.3).cpu()
    assert got.dtype == torch.float32 and got.shape == (t,)
    ref = _scores_ref(keys, q, w, 0.3)
    # float32 inside the kernel: within float32 rounding of the reference, for bfloat16 inputs too
    assert (got - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))
    portable = PortableKernels().index_scores_flat(keys, None, q, w, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 0.05  # the portable backend rounds to bfloat16 along the way
    assert (got - portable).abs().max() <= tol * max(1.0, float(ref.abs().max()))


def test_index_scores_flat_int8_keys_dequantised_on_load(triton_kernels, dev) -> None:
    g = torch.Generator().manual_seed(1)
    keys = torch.randint(-127, 128, (500, 32), dtype=torch.int8, generator=g)
    key_scale = (torch.rand(500, 1, generator=g) / 50 + 1e-3).half()
    q, w = torch.randn(4, 32, generator=g), torch.randn(4, generator=g)
    got = triton_kernels.index_scores_flat(keys.to(dev), key_scale.to(dev), q.to(dev), w.to(dev), 0.3).cpu()
    ref = _scores_ref(keys, q, w, 0.3) * key_scale[:, 0].float()
    assert (got - ref).abs().max() <= 1e-5 * float(ref.abs().max())
    assert torch.allclose(got, PortableKernels().index_scores_flat(keys, key_scale, q, w, 0.3), rtol=1e-5, atol=1e-5)
    # the scales matter: dropping them would be caught
    assert not torch.allclose(got, _scores_ref(keys, q, w, 0.3), rtol=1e-2)


def test_index_scores_flat_reads_a_strided_run_in_place(triton_kernels, dev) -> None:
    """Runs of the paged cache are row slices of a larger pool: the kernel follows the row stride."""
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(300, 48, generator=g)
    q, w = torch.randn(4, 32, generator=g), torch.randn(4, generator=g)
    got = triton_kernels.index_scores_flat(pool.to(dev)[:, 8:40], None, q.to(dev), w.to(dev), 0.5).cpu()
    assert torch.allclose(got, _scores_ref(pool[:, 8:40], q, w, 0.5), rtol=1e-5, atol=1e-5)


def test_topk_picks_the_portable_sets(triton_kernels, dev) -> None:
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 20000, generator=g)
    scores[1, 15000:] = float("-inf")
    a_idx, a_valid = triton_kernels.topk(scores.to(dev), 2048, ordered=False)
    b_idx, b_valid = PortableKernels().topk(scores, 2048, ordered=False)
    for row in range(3):
        assert set(a_idx[row].tolist()) == set(b_idx[row].tolist())
    assert bool(a_valid.all()) and bool(b_valid.all())
    idx, valid = triton_kernels.topk(torch.tensor([[1.0, float("-inf"), 3.0]], device=dev), 3)
    assert idx[0].tolist() == [2, 0, 1] and valid[0].tolist() == [True, True, False]


def _mla_ref(q_lat, q_rope, kv, valid, scale) -> torch.Tensor:
    c = q_lat.shape[-1]
    q = torch.cat([q_lat, q_rope], -1).float() * scale
    s = (q @ kv.float().transpose(1, 2)).masked_fill(~valid[:, None], float("-inf"))
    return s.softmax(-1) @ kv.float()[..., :c]


def _mla(kernels: DSAKernels, dev: str, *args: torch.Tensor, scale: float = 0.1) -> torch.Tensor:
    q_lat, q_rope, kv, valid = (a.to(dev) for a in args)
    res = kernels.sparse_mla(q_lat, q_rope, kv, valid, scale)
    assert res.entropy is None
    return res.out.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 32, 8, 40), (1, 64, 512, 64, 100), (3, 5, 20, 6, 7)])
def test_sparse_mla_matches_reference(triton_kernels, dev, dtype, shape) -> None:
    n, heads, c, r, k = shape
    g = torch.Generator().manual_seed(k)
    q_lat, q_rope = torch.randn(n, heads, c, generator=g).to(dtype), torch.randn(n, heads, r, generator=g).to(dtype)
    kv = torch.randn(n, k, c + r, generator=g).to(dtype)
    valid = torch.rand(n, k, generator=g) > 0.3
    valid[:, 0] = True
    out = _mla(triton_kernels, dev, q_lat, q_rope, kv, valid)
    assert out.dtype == dtype and out.shape == (n, heads, c)
    ref = _mla_ref(q_lat, q_rope, kv, valid, 0.1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bfloat16: one rounding of the output
    assert (out.float() - ref).abs().max() <= tol
    portable = PortableKernels().sparse_mla(q_lat, q_rope, kv, valid, 0.1).out
    assert (out.float() - portable.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 5e-2)


def test_sparse_mla_ignores_invalid_slots(triton_kernels, dev) -> None:
    g = torch.Generator().manual_seed(4)
    q_lat, q_rope = torch.randn(1, 4, 32, generator=g), torch.randn(1, 4, 8, generator=g)
    kv = torch.randn(1, 24, 40, generator=g)
    valid = torch.zeros(1, 24, dtype=torch.bool)
    valid[0, :5] = True
    a = _mla(triton_kernels, dev, q_lat, q_rope, kv, valid, scale=0.2)
    kv2 = kv.clone()
    kv2[0, 5:] = 1e4  # garbage in the invalid slots must not leak in
    assert torch.equal(a, _mla(triton_kernels, dev, q_lat, q_rope, kv2, valid, scale=0.2))
    assert torch.allclose(a, _mla_ref(q_lat, q_rope, kv[:, :5], valid[:, :5], 0.2), atol=1e-5)


def test_sparse_mla_with_entropy_uses_the_portable_path(triton_kernels, dev) -> None:
    g = torch.Generator().manual_seed(5)
    q_lat, q_rope = torch.randn(2, 4, 32, generator=g), torch.randn(2, 4, 8, generator=g)
    kv, valid = torch.randn(2, 20, 40, generator=g), torch.ones(2, 20, dtype=torch.bool)
    args = [t.to(dev) for t in (q_lat, q_rope, kv, valid)]
    a = triton_kernels.sparse_mla(*args, 0.1, want_entropy=True)
    b = PortableKernels().sparse_mla(*args, 0.1, want_entropy=True)
    assert a.entropy is not None and b.entropy is not None and float(a.entropy) == pytest.approx(float(b.entropy))
    assert torch.equal(a.out, b.out)


def test_engine_generates_the_same_tokens_with_the_triton_kernels(triton_kernels, dev, tmp_path: Path) -> None:
    """The whole decode path (paged in-place scoring over L1 and INT8 keys, top-k, sparse attention) on the
    Triton kernels: greedy tokens equal the portable engine's."""
    hf_checkpoint(tmp_path, seed=3, vocab_size=1024, index_topk=40, num_hidden_layers=4, index_topk_pattern="FFSF")
    write_tokenizer(tmp_path)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(20, 1000, (n,), generator=g).tolist() for n in (90, 60)]
    results = []
    for backend in ("portable", "triton"):
        engine = Engine(EngineConfig(
            model=str(tmp_path), device=dev, dtype="float32", kernels=backend, max_model_len=512,
            kv_cache_bytes=16 << 20, block_size=16, dense_warmup_tokens=0, l1_tokens=16, paged_scoring_min_tokens=0,
            max_num_batched_tokens=64,
        ))  # fmt: skip
        assert engine.kernels.name == backend
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", None, p, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
        got: dict[str, list[int]] = {}
        while engine.has_work:
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.token_ids)
        results.append(got)
    assert results[0] == results[1]
    assert all(len(v) == 6 for v in results[1].values())
