"""Which DSA kernel backend the engine gets, and the self-check that guards a device backend."""

from __future__ import annotations

import logging

import pytest
import torch
from glm5.errors import ConfigError
from glm5.kernels import AttentionOutput, PortableKernels, checked, kernels_for
from glm5_worker.config import EngineConfig

DIMS = (8, 32, 16, 4, 32)  # attention heads, kv_lora_rank, rope dim, indexer heads, indexer dim
CPU = torch.device("cpu")


def test_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(kernels_for(CPU), PortableKernels) and kernels_for(CPU).name == "portable"
    assert kernels_for(CPU, "portable").name == "portable"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        kernels_for(CPU, "triton")
    with pytest.raises(ConfigError, match="--kernels must be one of"):
        kernels_for(CPU, "fast")
    with pytest.raises(ConfigError, match="--kernels must be one of"):
        EngineConfig(kernels="fast")


class Broken(PortableKernels):
    name = "broken"

    def sparse_mla(self, *args, **kwargs) -> AttentionOutput:  # type: ignore[no-untyped-def]
        raise RuntimeError("out of shared memory")


class Wrong(PortableKernels):
    name = "wrong"

    def index_scores_flat(self, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return super().index_scores_flat(*args, **kwargs) * 1.5


@pytest.mark.parametrize("backend", [Broken, Wrong])
def test_a_failing_backend_falls_back_under_auto_and_fails_when_chosen(backend, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="glm5.kernels"):
        got = checked(backend(), "auto", CPU, DIMS, torch.float32)
    assert got.name == "portable"
    assert "failed their self-check" in caplog.text
    with pytest.raises(ConfigError, match="self-check failed"):
        checked(backend(), backend.name, CPU, DIMS, torch.float32)


def test_a_correct_backend_is_kept() -> None:
    class Same(PortableKernels):
        name = "same"

    kernels = Same()
    assert checked(kernels, "auto", CPU, DIMS, torch.float32) is kernels
    assert checked(kernels, "auto", CPU, DIMS, torch.bfloat16) is kernels
