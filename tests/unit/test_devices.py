from __future__ import annotations

import sys

import pytest
import torch
from glm5.devices import resolve_device
from glm5.errors import ConfigError


def test_auto_falls_back_to_what_exists_and_never_needs_torch_npu() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type in (expected, "npu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif("torch_npu" in sys.modules, reason="an Ascend stack is present")
def test_npu_without_cann_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="torch_npu"):
        resolve_device("npu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="CUDA"):
        resolve_device("cuda")


def test_unknown_device() -> None:
    with pytest.raises(ConfigError, match="one of"):
        resolve_device("tpu")
