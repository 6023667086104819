"""glm5.allocator: freed tensors stay in the process once it is applied (each case in a fresh interpreter,
since the setting is process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROBE = """
import os, sys, torch
from glm5.allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page touched
before = rss()
del x
print(before - rss())
"""

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)


def _released(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


def test_system_allocator_gives_a_large_freed_tensor_back() -> None:
    # the control: without the setting, glibc unmaps a 64 MiB block on free (above its 32 MiB mmap cap)
    assert _released("system") >= 48 << 20


def test_retained_memory_stays_in_the_process() -> None:
    assert _released("retain") <= 8 << 20
