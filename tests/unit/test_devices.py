from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from glm5.devices import available_memory, cgroup_free_memory, resolve_device
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


def test_cpu_memory_respects_the_container_limit(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8589934592\n")
    (v2 / "memory.current").write_text("1073741824\n")
    assert cgroup_free_memory(v2) == 7 << 30
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_free_memory(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(4 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(5 << 30))
    assert cgroup_free_memory(tmp_path / "v1") == 0  # over the limit already: nothing to give the KV pool
    (v1 / "memory.limit_in_bytes").write_text(str(1 << 62))
    assert cgroup_free_memory(tmp_path / "v1") is None
    assert cgroup_free_memory(tmp_path / "none") is None
    assert available_memory(torch.device("cpu")) >= 0
