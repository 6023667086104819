"""Device selection. torch_npu is imported only when an Ascend NPU is asked for (it cannot import without CANN)."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import torch

from glm5.errors import ConfigError

log = logging.getLogger(__name__)
DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except Exception:  # ImportError, or CANN libraries missing at import time
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def resolve_device(name: str) -> torch.device:
    """auto picks npu, then cuda, then cpu."""
    if name not in DEVICE_CHOICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {name!r}")
    if name == "auto":
        if _npu_available():
            return torch.device("npu")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if name == "npu" and not _npu_available():
        raise ConfigError("device npu asked for, but torch_npu is not importable or no Ascend NPU is visible")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def available_memory(device: torch.device) -> int:
    """Free memory on the device, in bytes. For CPU: the host's MemAvailable, capped by the container's cgroup
    memory limit (in a pod, the node's free memory is not ours to take)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "npu":
        return int(torch.npu.mem_get_info(device)[0])  # type: ignore[attr-defined]
    free = 4 << 30
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    limited = cgroup_free_memory()
    return min(free, limited) if limited is not None else free


def cgroup_free_memory(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, else v1); None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # fmt: skip
        try:
            raw = (root / limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:  # v1 reports "no limit" as a huge number
                return None
            return max(0, int(raw) - int((root / usage_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None
