"""Real processes on localhost ports for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from glm5.security import NO_TLS, Secret, TlsConfig, sync_channel
from grpc_health.v1 import health_pb2, health_pb2_grpc

# UpdateWeights needs an admin caller and a weights root: workers started here get the token in their environment
ADMIN_ENV = "GLM5_TEST_ADMIN_TOKEN"
ADMIN_TOKEN = Secret("test-admin-token")
# and the internal token (workers that get --internal-token-env INTERNAL_ENV require it on every call)
INTERNAL_ENV = "GLM5_TEST_INTERNAL_TOKEN"
INTERNAL_TOKEN = Secret("test-internal-token")


def admin_flags(weights_root: Path) -> tuple[str, ...]:
    """`glm5 worker` flags that let ADMIN_TOKEN's holders load checkpoints from under `weights_root`."""
    return ("--admin-token-env", ADMIN_ENV, "--weights-root", str(weights_root))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(target: str, timeout: float = 120.0, proc: subprocess.Popen | None = None,
                 tls: TlsConfig = NO_TLS, service: str = "") -> None:  # fmt: skip
    """Until `target`'s grpc.health.v1 says SERVING for `service` ("": the process; a service name: ready)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before serving")
        # a fresh channel per try: one refused at first waits out gRPC's reconnect backoff (seconds) before retrying
        with sync_channel(target, tls) as channel:
            try:
                request = health_pb2.HealthCheckRequest(service=service)
                if health_pb2_grpc.HealthStub(channel).Check(request, timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.2)
    raise TimeoutError(f"{target} not serving after {timeout}s")


def start_worker(
    model: Path, *extra: str, log: Path | None = None, port: int | None = None, tls: TlsConfig = NO_TLS
) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    cmd = [sys.executable, "-m", "glm5_cli", "worker", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), *extra]  # fmt: skip
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - owned by the process
    env = {**os.environ, ADMIN_ENV: ADMIN_TOKEN.value, INTERNAL_ENV: INTERNAL_TOKEN.value}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    target = f"127.0.0.1:{port}"
    wait_serving(target, proc=proc, tls=tls)
    return proc, target


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0, ca: Path | None = None) -> None:
    import ssl
    import urllib.error
    import urllib.request

    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before serving {url}")
        try:
            with urllib.request.urlopen(url, timeout=1, context=context):
                return
        except urllib.error.HTTPError:
            return  # it answers (503 while no worker is ready is still an answer)
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} not answering after {timeout}s")


def start_scripted_worker(
    stats_file: Path | None = None, port: int | None = None, *extra: str
) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    cmd = [sys.executable, "-m", "tests.helpers.scripted_worker", "--port", str(port), *extra]
    if stats_file is not None:
        cmd += ["--stats-file", str(stats_file)]
    proc = subprocess.Popen(cmd, env=os.environ.copy(), cwd=Path(__file__).resolve().parents[2])
    target = f"127.0.0.1:{port}"
    wait_serving(target, proc=proc)
    return proc, target


def start_router(
    workers: list[str],
    *extra: str,
    log: Path | None = None,
    tls: TlsConfig = NO_TLS,
    https_ca: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str, str]:
    """A `glm5 router` process: (process, gRPC target, HTTP base URL ending in /v1); `tls` to reach its gRPC
    port, `https_ca` when it serves HTTPS."""
    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "glm5_cli", "router", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
           "--http-port", str(http_port), "--stats-interval", "0.2", *extra]  # fmt: skip
    for w in workers:
        cmd += ["--worker", w]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    base = f"{'https' if https_ca else 'http'}://127.0.0.1:{http_port}"
    wait_http(base + "/health", proc, ca=https_ca)
    wait_serving(f"127.0.0.1:{grpc_port}", proc=proc, tls=tls)
    return proc, f"127.0.0.1:{grpc_port}", base + "/v1"


def start_redis(workdir: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A real redis-server on a free localhost port, or `port` (a restart), without persistence: (process, URL)."""
    import shutil

    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed: apt-get install -y redis-server (.ci/run does)"
    port = port or free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise TimeoutError("redis-server did not start")
