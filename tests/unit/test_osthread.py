"""glm5.osthread: the OS sees a thread's name, and the threads it starts inherit it."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from glm5.osthread import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names threads on Linux only")


def _comm(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def test_a_named_thread_and_the_threads_it_starts_carry_the_name() -> None:
    seen: dict[str, str] = {}

    def child() -> None:
        seen["child"] = _comm(threading.get_native_id())

    def named() -> None:
        name_os_thread("glm5-test-thread-long-name")  # the kernel keeps 15 bytes
        seen["named"] = _comm(threading.get_native_id())
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=named)
    t.start()
    t.join()
    assert seen == {"named": "glm5-test-threa", "child": "glm5-test-threa"}
    assert _comm(threading.get_native_id()) != "glm5-test-threa"  # the caller's own thread is untouched
