"""`glm5 serve`: the whole stack on this machine: N worker processes and the router, one command, clean
shutdown on Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from glm5.errors import ConfigError
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("glm5.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (model replicas)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    p.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    p.add_argument("--grpc-port", type=int, default=50050)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--redis-url", help="share the queue through Redis (default: in-process)")
    p.add_argument(
        "--thinking-policy",
        default="deep",
        choices=["off", "light", "deep", "auto"],
        help="default reasoning mode (deep: the shipped demo model always reasons before answering)",
    )
    p.add_argument("--sm4-key-dir", help="accept SM4-GCM sealed gRPC requests with these keys")
    p.add_argument("--worker-arg", action="append", default=[], help="extra `glm5 worker` flag (repeatable), "
                   "e.g. --worker-arg=--max-num-seqs=32")  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a worker may take to load")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(target: str, proc: subprocess.Popen[bytes], timeout: float, what: str = "worker") -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ConfigError(f"{what} on {target} exited with status {proc.returncode} while loading "
                                  f"(its log is above)")  # fmt: skip
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise ConfigError(f"{what} on {target} not serving after {timeout:.0f}s (--startup-timeout)")


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(a: argparse.Namespace) -> None:
    from glm5.model.presets import default_model_path
    from glm5_router.config import RouterConfig
    from glm5_router.server.app import start_router

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.workers < 1:
        raise ConfigError("--workers must be >= 1")
    model = Path(a.model) if a.model else default_model_path()  # built once, before the workers race for it
    procs: list[subprocess.Popen[bytes]] = []
    targets = []
    try:
        for _ in range(a.workers):
            port = free_port()
            cmd = [sys.executable, "-m", "glm5_cli", "worker", "--model", str(model), "--host", "127.0.0.1",
                   "--port", str(port), "--device", a.device, *a.worker_arg]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=os.environ.copy()))
            targets.append(f"127.0.0.1:{port}")
        for target, proc in zip(targets, procs, strict=True):
            wait_serving(target, proc, a.startup_timeout)
        config = RouterConfig(
            workers=tuple(targets), host=a.host, grpc_port=a.grpc_port, http_port=a.http_port,
            redis_url=a.redis_url, thinking_policy=a.thinking_policy, sm4_key_dir=a.sm4_key_dir,
        )  # fmt: skip
        asyncio.run(_serve(config, start_router))
    finally:
        stop_processes(procs)


async def _serve(config: object, start_router: object) -> None:
    from glm5_router.config import RouterConfig
    from glm5_router.server.app import RouterApp

    assert isinstance(config, RouterConfig) and callable(start_router)
    app: RouterApp = await start_router(config)
    await app.pool.wait_ready(60)
    host = "localhost" if config.host in ("0.0.0.0", "127.0.0.1") else config.host
    print(f"\nglm5 is serving {app.frontend.model_name} with {len(config.workers)} worker(s)\n"
          f"  OpenAI HTTP: http://{host}:{app.http_port}/v1\n"
          f"  gRPC:        {host}:{app.grpc_port}\n"
          f"  try:         glm5 chat 'What is 2 + 3?'   (Ctrl-C stops everything)\n", flush=True)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("stopping...", flush=True)
    await app.stop(5.0)
