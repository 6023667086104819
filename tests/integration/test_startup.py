"""Start-up checks come before any model work: a taken port or a missing model fails `glm5 worker` and `glm5 serve`
within seconds with one error line, having loaded and compiled nothing (issue 34: a busy port used to fail after
minutes of compiling)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.procs import free_port

# what a worker logs once it does model work (reading weights, the KV pool, compiling)
MODEL_WORK = ("weights on", "KV pool", "compil", "loading")


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def _glm5(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Runs `glm5 ARGS` with compiled decode steps on (the suite's default is eager) and a fresh compile cache."""
    env = {**os.environ, "GLM5_ENFORCE_EAGER": "0", "GLM5_COMPILE_CACHE": str(tmp_path / "compile")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "glm5_cli", *args], capture_output=True, text=True, timeout=120,
                          env=env)  # fmt: skip
    return proc, time.monotonic() - start


def _failed_before_loading(proc: subprocess.CompletedProcess[str], took: float, tmp_path: Path, names: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert took < 5, f"took {took:.1f} s"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and names in errors[0], out[-3000:]
    assert "Traceback" not in out and not any(w in out for w in MODEL_WORK), out[-3000:]
    assert not (tmp_path / "compile").exists()  # nothing compiled


def test_worker_on_a_busy_port_fails_before_loading(tmp_path: Path, busy_port: int) -> None:
    proc, took = _glm5(tmp_path, "worker", "--port", str(busy_port))
    _failed_before_loading(proc, took, tmp_path, f"cannot listen on 127.0.0.1:{busy_port}")


def test_worker_with_a_missing_model_fails_before_binding(tmp_path: Path) -> None:
    port = free_port()
    proc, took = _glm5(tmp_path, "worker", "--port", str(port), "--model", str(tmp_path / "nowhere"))
    _failed_before_loading(proc, took, tmp_path, "nowhere")


@pytest.mark.parametrize("which", ["grpc", "http"])
def test_serve_on_a_busy_port_fails_before_starting_a_worker(tmp_path: Path, busy_port: int, which: str) -> None:
    ports = {"grpc": free_port(), "http": free_port(), which: busy_port}
    proc, took = _glm5(tmp_path, "serve", "--grpc-port", str(ports["grpc"]), "--http-port", str(ports["http"]))
    label = {"grpc": "gRPC", "http": "HTTP"}[which]
    _failed_before_loading(proc, took, tmp_path, f"cannot listen on 127.0.0.1:{busy_port} ({label}, --{which}-port)")
    assert "glm5_cli worker" not in proc.stderr  # no worker was started


def test_serve_with_a_missing_model_fails_at_once(tmp_path: Path) -> None:
    proc, took = _glm5(tmp_path, "serve", "--grpc-port", str(free_port()), "--http-port", str(free_port()),
                       "--model", str(tmp_path / "nowhere"))  # fmt: skip
    _failed_before_loading(proc, took, tmp_path, "no config.json")
