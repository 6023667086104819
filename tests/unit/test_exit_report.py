"""The nanobind leak report libtriton leaves at exit is dropped, and only it: a process's other last words (an error
written during interpreter teardown, after every exit handler) still reach stderr."""

from __future__ import annotations

import subprocess
import sys

REPORT = (
    "nanobind: leaked 4 instances!\\n"
    ' - leaked instance 0x7f54b2348328 of type "triton._C.libtriton.ir.attribute"\\n'
    "nanobind: leaked 64 types!\\n"
    ' - leaked type "triton._C.libtriton.ir.location"\\n'
    " - ... skipped remainder\\n"
    "nanobind: this is likely caused by a reference counting issue in the binding code.\\n"
    "See https://nanobind.readthedocs.io/en/latest/refleaks.html\\n"
)
# what nanobind does: write at interpreter teardown, after the exit handlers; here with a real error line among it
PROGRAM = f"""
import os, sys
import glm5_cli  # what every glm5 command imports first
{{imports}}

class Teardown:
    def __del__(self):
        os.write(2, b"error: cannot listen on 127.0.0.1:50050\\n" + {REPORT!r}.encode())

keep = Teardown()
print("error: cannot listen on 127.0.0.1:50050", file=sys.stderr)
"""


def _stderr(imports: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(imports=imports)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    return done.stderr


def test_the_leak_report_is_dropped_when_libtriton_is_loaded() -> None:
    err = _stderr("import triton._C.libtriton")
    assert "nanobind" not in err and "leaked" not in err, err
    assert err.splitlines() == ["error: cannot listen on 127.0.0.1:50050"] * 2


def test_nothing_is_filtered_without_libtriton() -> None:
    err = _stderr("")
    assert "nanobind: leaked 4 instances!" in err and err.count("error: cannot listen") == 2
