"""Drops one known report from a process's last words: triton 3.9's libtriton leaves a few nanobind objects alive
at interpreter exit, and nanobind then prints ~30 lines (`nanobind: leaked 4 instances!`, the leaked types and
functions, a link) on stderr after everything the process said, so the user's last line is that report instead
of the error that ended the process. The objects are created by inductor's use of triton while it compiles decode
steps (a plain `import triton` leaves none) and freed by the OS at exit: the report is noise, as triton itself
decides for its own compile workers (it sends their stderr to /dev/null at exit). Here only the report's lines
are dropped; anything else written to stderr at exit still reaches it."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys

# the report's lines: its headers, its "- leaked ..." items, its closing advice
REPORT_PREFIXES = ("nanobind: ", " - leaked ", " - ... skipped remainder", "See https://nanobind.readthedocs.io/")
_FILTER = f"""
import os, sys
prefixes = {REPORT_PREFIXES!r}
data = sys.stdin.buffer.read().decode("utf-8", "replace")
kept = [line for line in data.splitlines(keepends=True) if not line.startswith(prefixes)]
os.write(2, "".join(kept).encode())
"""


def drop_nanobind_leak_report() -> None:
    """From now on, an exit of this process that happens with libtriton loaded loses the leak report."""
    atexit.register(_filter_stderr)  # registered early, so it runs after the other exit handlers


def _filter_stderr() -> None:
    if "triton._C.libtriton" not in sys.modules:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        # a separate interpreter (spawned, not forked: this process has other threads) holds the terminal's stderr
        # and forwards what is not the report once this process is gone and the pipe closes
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _FILTER], stdin=read, stderr=2, close_fds=True)
        os.close(read)
        os.dup2(write, 2)
        os.close(write)
    except OSError:
        pass  # no filter: the report shows, nothing else changes


__all__ = ["REPORT_PREFIXES", "drop_nanobind_leak_report"]
