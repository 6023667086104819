"""Device backends against the portable kernels on CPU, wherever the device exists (skipped otherwise)."""

from __future__ import annotations

import pytest
import torch
from glm5.kernels import PortableKernels, kernels_for


def _inputs(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {
        "q": torch.randn(1, 4, 8, 32, generator=g),
        "w": torch.randn(1, 4, 8, generator=g),
        "keys": torch.randn(1, 300, 32, generator=g),
        "q_lat": torch.randn(4, 16, 64, generator=g),
        "q_rope": torch.randn(4, 16, 16, generator=g),
        "kv": torch.randn(4, 40, 80, generator=g),
        "valid": torch.rand(4, 40, generator=g) > 0.2,
    }
    return {k: v.to(device) for k, v in t.items()}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_backend_matches_portable_cpu() -> None:
    ref, dev = _inputs("cpu"), _inputs("cuda")
    cpu, gpu = PortableKernels(), kernels_for(torch.device("cuda"))
    a = cpu.index_scores(ref["q"], ref["w"], ref["keys"], 0.1)
    b = gpu.index_scores(dev["q"], dev["w"], dev["keys"], 0.1)
    assert torch.allclose(a, b.cpu(), atol=1e-4)
    a = cpu.sparse_mla(ref["q_lat"], ref["q_rope"], ref["kv"], ref["valid"], 0.1).out
    b = gpu.sparse_mla(dev["q_lat"], dev["q_rope"], dev["kv"], dev["valid"], 0.1).out
    assert torch.allclose(a, b.cpu(), atol=1e-4)


@pytest.mark.npu
def test_npu_backend_matches_portable_cpu() -> None:
    torch_npu = pytest.importorskip("torch_npu", reason="needs torch_npu and an Ascend NPU (CANN)")
    if not torch_npu.npu.is_available():
        pytest.skip("no Ascend NPU visible")
    ref, dev = _inputs("cpu"), _inputs("npu")
    a = PortableKernels().sparse_mla(ref["q_lat"], ref["q_rope"], ref["kv"], ref["valid"], 0.1).out
    b = kernels_for(torch.device("npu")).sparse_mla(dev["q_lat"], dev["q_rope"], dev["kv"], dev["valid"], 0.1).out
    assert torch.allclose(a, b.cpu(), atol=1e-3)
