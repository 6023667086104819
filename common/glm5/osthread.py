"""The operating system's name for the calling thread, so `top -H`, `ps -L`, py-spy and /proc show which of a
server's threads is which (Python 3.11's threading names a thread for Python only; 3.14 passes it on)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15  # prctl(2)
_NAME_BYTES = 15  # the kernel keeps 16 bytes, the last a NUL


def name_os_thread(name: str) -> None:
    """Names the calling thread (Linux; elsewhere nothing). Threads it starts later (libgomp's pool for its
    parallel regions) inherit the name: a thread's CPU and its pool's can be told apart from the others'."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:_NAME_BYTES], 0, 0, 0)
