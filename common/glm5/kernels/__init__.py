"""DSA kernels behind one small interface; the portable PyTorch backend is the reference for the others."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from glm5.errors import ConfigError
from glm5.kernels.base import AttentionOutput, DSAKernels
from glm5.kernels.portable import PortableKernels

__all__ = ["KERNEL_CHOICES", "AttentionOutput", "DSAKernels", "PortableKernels", "checked", "kernels_for"]
KERNEL_CHOICES = ("auto", "portable", "triton")
log = logging.getLogger(__name__)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernels_for(device: torch.device, choice: str = "auto") -> DSAKernels:
    """The backend for a device: `auto` picks the Triton kernels on CUDA when Triton is installed (it comes with
    PyTorch's CUDA wheels) and the portable ones elsewhere. Each backend is tested against PortableKernels."""
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"--kernels must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    if choice == "portable" or (choice == "auto" and (device.type != "cuda" or not triton_available())):
        return PortableKernels()
    if not triton_available():
        raise ConfigError("--kernels triton: the triton package is not installed (pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"--kernels triton needs a CUDA device, the worker runs on {device.type} (TRITON_INTERPRET=1 runs the "
            f"kernels under Triton's CPU interpreter: for debugging, very slow)"
        )
    from glm5.kernels.triton_kernels import TritonKernels

    return TritonKernels()


def checked(kernels: DSAKernels, choice: str, device: torch.device, dims: tuple[int, int, int, int, int],
            dtype: torch.dtype) -> DSAKernels:  # fmt: skip
    """Runs a device backend once at the model's sizes (attention heads, kv_lora_rank, rope dim, indexer heads,
    indexer dim) against the portable kernels before the engine relies on it. A backend that fails to build
    or disagrees is replaced by the portable one with a warning under `auto`; an explicit choice fails."""
    if kernels.name == "portable":
        return kernels
    heads, rank, rope, index_heads, index_dim = dims
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(300, index_dim, generator=g)
    q, w = torch.randn(index_heads, index_dim, generator=g), torch.randn(index_heads, generator=g)
    q_lat, q_rope = torch.randn(2, heads, rank, generator=g), torch.randn(2, heads, rope, generator=g)
    kv, valid = torch.randn(2, 40, rank + rope, generator=g), torch.rand(2, 40, generator=g) > 0.2
    valid[:, 0] = True
    ref = PortableKernels()
    d_lat, d_rope, d_kv = (t.to(device, dtype) for t in (q_lat, q_rope, kv))
    try:
        cases = [
            (kernels.index_scores_flat(keys.to(device, dtype), None, q.to(device, dtype), w.to(device), 0.1),
             ref.index_scores_flat(keys, None, q, w, 0.1)),
            (kernels.sparse_mla(d_lat, d_rope, d_kv, valid.to(device), 0.1).out,
             ref.sparse_mla(q_lat, q_rope, kv, valid, 0.1).out),
        ]  # fmt: skip
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        for got, want in cases:
            err = float((got.float().cpu() - want).abs().max())
            if not err <= tol * max(1.0, float(want.abs().max())):
                raise ValueError(f"differs from the portable kernels by {err:.3g}")
    except Exception as exc:  # a kernel that cannot build on this device is an expected failure here
        if choice != "auto":
            raise ConfigError(f"--kernels {kernels.name}: self-check failed on {device}: {exc}") from exc
        log.warning("the %s kernels failed their self-check on %s (%s): using the portable ones", kernels.name,
                    device, exc)  # fmt: skip
        return PortableKernels()
    return kernels
