"""What a user sees when a service cannot start: one line that names the problem, no traceback, no secret."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.procs import free_port


def _glm5(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "glm5_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def test_operator_without_cluster_credentials_says_so_once(tmp_path: Path) -> None:
    proc = _glm5("operator", env={"KUBECONFIG": str(tmp_path / "missing"), "HOME": str(tmp_path)})
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no Kubernetes credentials" in lines[0], proc.stderr


@pytest.mark.parametrize("which", ["grpc", "http"])
def test_router_on_a_busy_port_names_it(which: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"grpc": port, "http": free_port()} if which == "grpc" else {"grpc": free_port(), "http": port}
        proc = _glm5("router", "--worker", "127.0.0.1:1", "--grpc-port", str(ports["grpc"]), "--http-port",
                     str(ports["http"]))  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and which.replace("http", "HTTP").replace(
        "grpc", "gRPC") in errors[0], proc.stderr  # fmt: skip


def test_an_unreachable_redis_is_named_without_its_password() -> None:
    proc = _glm5("router", "--worker", "127.0.0.1:1", "--grpc-port", str(free_port()), "--http-port",
                 str(free_port()), "--redis-url", "redis://:hunter2secret@127.0.0.1:1/0")  # fmt: skip
    assert proc.returncode == 2
    assert "cannot reach redis://:***@127.0.0.1:1/0" in proc.stderr
    assert "hunter2secret" not in proc.stderr + proc.stdout


def test_a_second_router_cannot_share_the_grpc_port() -> None:
    """gRPC's default SO_REUSEPORT would let it bind and take half the connections silently."""
    from tests.helpers.procs import start_router, stop

    first, grpc_target, _ = start_router(["127.0.0.1:1"])
    try:
        port = grpc_target.rpartition(":")[2]
        proc = _glm5("router", "--worker", "127.0.0.1:1", "--grpc-port", port, "--http-port", str(free_port()))
        assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port} (gRPC)" in proc.stderr, proc.stderr
    finally:
        stop(first)


def test_glm5_generate_reaches_a_router_and_a_worker(tiny_model: Path) -> None:
    from tests.helpers.procs import start_router, start_worker, stop

    worker, worker_target = start_worker(tiny_model, "--max-model-len", "256", "--kv-cache-bytes", "16MiB")
    router, router_target, _ = start_router([worker_target])
    try:
        for target in (router_target, worker_target):
            proc = _glm5("generate", "--target", target, "--max-new-tokens", "4", "--temperature", "0", "1 + 1")
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert "+ 4 generated tokens]" in proc.stderr, proc.stderr
    finally:
        stop(router)
        stop(worker)
