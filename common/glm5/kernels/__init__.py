"""DSA kernels behind one small interface; the portable PyTorch backend is the reference for the others."""

from __future__ import annotations

import torch

from glm5.kernels.base import AttentionOutput, DSAKernels
from glm5.kernels.portable import PortableKernels

__all__ = ["AttentionOutput", "DSAKernels", "PortableKernels", "kernels_for"]


def kernels_for(device: torch.device) -> DSAKernels:
    """The best backend for a device. CUDA and Ascend backends plug in here; each is tested against
    PortableKernels on its device, and the portable backend is used wherever none is registered."""
    return PortableKernels()
