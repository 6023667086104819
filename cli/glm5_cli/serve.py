"""`glm5 serve`: the whole stack on this machine: N worker processes and the router, one command, clean
shutdown on Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import grpc
from glm5.errors import BindError, ConfigError

if TYPE_CHECKING:
    from glm5_router.config import RouterConfig
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("glm5.serve")
INTERNAL_ENV = "GLM5_INTERNAL_TOKEN"  # the run's internal token, in the workers' environment only


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (model replicas)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"],
                   help="where the workers run the model (auto: an accelerator if any, else the CPU)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    p.add_argument("--grpc-port", type=int, default=50050, help="the router's gRPC API (glm5.v1.Router)")
    p.add_argument("--http-port", type=int, default=8000, help="the router's OpenAI-compatible HTTP API")
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
    p.add_argument("--router-arg", action="append", default=[], help="extra `glm5 router` flag (repeatable), "
                   "e.g. --router-arg=--max-queued=100")  # fmt: skip
    g = p.add_argument_group("who may call the router (docs/security.md); the workers answer only the router")
    g.add_argument("--api-key", action="append", default=[],
                   help="a key clients must send as 'Authorization: Bearer' (repeatable; visible to `ps`: prefer "
                   "--api-key-env or --api-key-file)")  # fmt: skip
    g.add_argument("--api-key-env", help="environment variable holding API keys (comma-separated)")
    g.add_argument("--api-key-file", help="file of API keys, one per line")
    g.add_argument("--http-tls-cert", help="PEM certificate: serve the OpenAI API over HTTPS")
    g.add_argument("--http-tls-key", help="PEM private key of --http-tls-cert")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a worker may take to load")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests may take to finish on Ctrl-C / SIGTERM")  # fmt: skip
    p.add_argument("--no-worker-timeout", type=float, default=10.0,
                   help="with every worker down, seconds a request waits before it fails with 503")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_free(host: str, port: int, what: str) -> None:
    """Fails at once, before anything loads, when `host:port` is taken (the router binds it once its workers
    serve, seconds later: a port taken in between fails then, with the same error)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]  # fmt: skip
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no owner
            s.bind(address)
    except OSError as exc:
        raise BindError(f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}") from None


# a worker that is not listening yet is retried every second at most (gRPC's default backoff grows to 120 s)
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]


def wait_serving(target: str, proc: subprocess.Popen[bytes], timeout: float, what: str = "worker") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"{what} on {target} exited with status {proc.returncode} while loading "
                              f"(its log is above)")  # fmt: skip
        # a fresh channel per try: one whose first connect was refused waits out gRPC's reconnect backoff (~5 s
        # measured) before it tries again, long after the server is up
        with grpc.insecure_channel(target, options=RECONNECT) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
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


class Supervisor:
    """Keeps `glm5 serve`'s workers running. One that exits (a crash, the OOM killer, a SIGKILL) is started
    again on the same port after a backoff (1 s, doubling up to 30 s, back to 1 s once it has run for a
    minute); the router's health polls take it back into rotation when it serves. Meanwhile the router sends
    its requests to the other workers, or, with none left, fails them with 503 after --no-worker-timeout."""

    MIN_BACKOFF_S, MAX_BACKOFF_S, STABLE_S = 1.0, 30.0, 60.0

    def __init__(self, commands: list[list[str]], targets: list[str], env: dict[str, str] | None = None) -> None:
        self.commands, self.targets = commands, targets
        self.env = env
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(commands)
        self.started = [0.0] * len(commands)
        self.backoff = [self.MIN_BACKOFF_S] * len(commands)
        self.restart_at: list[float | None] = [None] * len(commands)
        self.restarts = 0

    def start(self, i: int) -> None:
        self.procs[i] = subprocess.Popen(self.commands[i], env=self.env if self.env is not None else os.environ.copy())
        self.started[i] = time.monotonic()

    def start_all(self) -> None:
        for i in range(len(self.commands)):
            self.start(i)

    def wait_all(self, timeout: float) -> None:
        """Until every worker serves; a worker that exits meanwhile is an error (its log says why)."""
        for target, proc in zip(self.targets, self.procs, strict=True):
            assert proc is not None
            wait_serving(target, proc, timeout)

    def check(self) -> None:
        """One supervision pass: notice exits, restart what is due."""
        now = time.monotonic()
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is None:
                continue
            if self.restart_at[i] is None:
                if now - self.started[i] >= self.STABLE_S:
                    self.backoff[i] = self.MIN_BACKOFF_S
                self.restart_at[i] = now + self.backoff[i]
                log.warning("worker on %s exited with status %s; restarting in %.0fs", self.targets[i],
                            proc.returncode, self.backoff[i])  # fmt: skip
                self.backoff[i] = min(self.backoff[i] * 2, self.MAX_BACKOFF_S)
            elif now >= self.restart_at[i]:  # type: ignore[operator]
                self.restart_at[i] = None
                self.restarts += 1
                log.info("restarting the worker on %s", self.targets[i])
                self.start(i)

    async def watch(self, interval: float = 0.5) -> None:
        while True:
            self.check()
            await asyncio.sleep(interval)

    def signal_all(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float) -> None:
        self.signal_all()
        stop_processes([p for p in self.procs if p is not None], timeout)


def router_config(a: argparse.Namespace, targets: list[str]) -> RouterConfig:
    """The router's settings as `glm5 router` would read them from these flags (its own parser: every router flag
    works through --router-arg, and the checks are the router's)."""
    from glm5_router.cli import add_arguments as router_arguments
    from glm5_router.cli import config_from_args

    argv = [f"--worker={t}" for t in targets]
    argv += [f"--host={a.host}", f"--grpc-port={a.grpc_port}", f"--http-port={a.http_port}",
             f"--thinking-policy={a.thinking_policy}", f"--no-worker-timeout={a.no_worker_timeout}",
             *[f"--api-key={k}" for k in a.api_key]]  # fmt: skip
    for flag, value in (("--redis-url", a.redis_url), ("--sm4-key-dir", a.sm4_key_dir), ("--api-key-env",
                        a.api_key_env), ("--api-key-file", a.api_key_file), ("--http-tls-cert", a.http_tls_cert),
                        ("--http-tls-key", a.http_tls_key)):  # fmt: skip
        if value:
            argv.append(f"{flag}={value}")
    parser = _RouterFlags(prog="glm5 serve --router-arg")
    router_arguments(parser)
    return config_from_args(parser.parse_args([*argv, *a.router_arg]))


class _RouterFlags(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would print the router's usage and exit
        raise ConfigError(f"--router-arg: {message}")


def run(a: argparse.Namespace) -> None:
    """Checks the ports, the model and the flags, then starts the workers (each binds its port, then loads) and,
    once they serve, the router: a taken port or a missing model fails within a second, not after a load."""
    from glm5.security import Secret

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.workers < 1:
        raise ConfigError("--workers must be >= 1")
    check_free(a.host, a.http_port, "HTTP, --http-port")
    check_free(a.host, a.grpc_port, "gRPC, --grpc-port")
    if a.model and not (Path(a.model) / "config.json").is_file():
        raise ConfigError(f"--model {a.model}: no config.json there (a HuggingFace-format checkpoint directory)")
    targets = [f"127.0.0.1:{free_port()}" for _ in range(a.workers)]
    # The workers answer the router only (another local user's process reaches 127.0.0.1 too): a fresh internal
    # token per run, in the workers' environment (never on a command line, which `ps` shows) and the router's
    # memory; it is written nowhere.
    token = Secret(secrets.token_urlsafe(32))
    config = dataclasses.replace(router_config(a, targets), internal_token=token)
    from glm5.model.presets import default_model_path  # imports torch: after the checks above

    model = Path(a.model) if a.model else default_model_path()  # built once, before the workers race for it
    commands = [[sys.executable, "-m", "glm5_cli", "worker", "--model", str(model), "--host", "127.0.0.1",
                 "--port", t.rpartition(":")[2], "--device", a.device, "--shutdown-grace", str(a.shutdown_grace),
                 "--internal-token-env", INTERNAL_ENV, *a.worker_arg] for t in targets]  # fmt: skip
    supervisor = Supervisor(commands, targets, {**os.environ, INTERNAL_ENV: token.value})
    try:
        supervisor.start_all()
        # the router starts once the workers serve (eagerly, seconds after they start): until it listens nothing
        # answers, so whoever waits for its port waits for a stack that serves
        supervisor.wait_all(a.startup_timeout)
        asyncio.run(_serve(config, supervisor, a.shutdown_grace))
    finally:
        supervisor.stop(a.shutdown_grace + 3)


def banner(config: RouterConfig, model: str, http_port: int, grpc_port: int) -> str:
    """What serves where, and a first command that reaches it as started (the real port, a key if one is needed)."""
    from glm5_cli.chat import DEFAULT_URL, URL_ENV

    host = "localhost" if config.host in ("0.0.0.0", "127.0.0.1") else config.host
    url = f"{'https' if config.http_tls.enabled else 'http'}://{host}:{http_port}/v1"
    chat = "glm5 chat 'What is 12 + 30?'"
    if url != DEFAULT_URL:
        chat = f"{URL_ENV}={url} {chat}"
    if config.api_keys:
        chat = f"GLM5_API_KEY=<key> {chat}"
    return (f"\nglm5 is serving {model} with {len(config.workers)} worker(s)"
            f"{' (API keys required)' if config.api_keys else ''}\n"
            f"  OpenAI HTTP: {url}\n"
            f"  gRPC:        {host}:{grpc_port} (glm5.v1.Router, with reflection)\n"
            f"  workers:     {', '.join(config.workers)} (they answer this router only)\n"
            f"  try:         {chat}   (Ctrl-C stops everything)\n")  # fmt: skip


async def _serve(config: RouterConfig, supervisor: Supervisor, grace: float) -> None:
    from glm5.serving import freeze_heap
    from glm5_router.server.app import start_router

    app = await start_router(config)
    freeze_heap()
    await app.pool.wait_ready(60)
    print(banner(config, app.frontend.model_name, app.http_port, app.grpc_port), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(supervisor.watch())
    await stop.wait()
    print("stopping...", flush=True)
    watcher.cancel()
    supervisor.signal_all()  # the workers drain their running requests while the router drains its streams
    await app.stop(grace)
