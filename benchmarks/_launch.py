"""`glm5` processes for the benchmarks, started the way `glm5 rl` and `glm5 serve` start them
(cli/glm5_cli/rl.py, serve.py): a fresh admin token and internal token per run, handed over in the environment
(never on a command line), a bounded wait for each process to serve that says how long it took, and its output
in a log file whose tail is shown when it fails.

Not a benchmark (the leading underscore): benchmarks/rl_loop.py and benchmarks/breaker_soak.py use it.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from glm5.security import Secret

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.procs import free_port, wait_serving

ADMIN_ENV = "GLM5_BENCH_ADMIN_TOKEN"  # the environment variables the tokens travel in (their flags name them)
INTERNAL_ENV = "GLM5_BENCH_INTERNAL_TOKEN"
COMPILE_HINT = "a worker compiles its decode steps at start-up (minutes on a cold cache); --enforce-eager skips it"


@dataclass(frozen=True, slots=True)
class Tokens:
    """The run's admin token (UpdateWeights) and internal token (every call to a worker)."""

    admin: Secret
    internal: Secret

    @classmethod
    def fresh(cls) -> Tokens:
        return cls(Secret(secrets.token_urlsafe(32)), Secret(secrets.token_urlsafe(32)))

    def env(self) -> dict[str, str]:
        return {ADMIN_ENV: self.admin.value, INTERNAL_ENV: self.internal.value}

    @staticmethod
    def internal_flags() -> list[str]:
        """For the worker, the router, the TITO gateway: every call to a worker carries the internal token."""
        return ["--internal-token-env", INTERNAL_ENV]

    @staticmethod
    def worker_flags(weights_root: Path) -> list[str]:
        """For a worker that takes weight pushes from the admin token's holder, from under `weights_root` only."""
        return ["--admin-token-env", ADMIN_ENV, "--internal-token-env", INTERNAL_ENV, "--weights-root",
                str(weights_root)]  # fmt: skip


@dataclass
class Started:
    proc: subprocess.Popen[bytes]
    target: str  # host:port
    seconds: float  # from start to serving
    log: Path


def start(args: Sequence[str], tokens: Tokens, log: Path, timeout_s: float, cpus: set[int] | None = None,
          threads: int | None = None, what: str = "") -> Started:  # fmt: skip
    """`glm5 ARGS --host 127.0.0.1 --port P` (on `cpus`, one OpenMP thread, when given; `threads` OpenMP threads
    when given), once it serves."""
    port = free_port()
    cmd = [sys.executable, "-m", "glm5_cli", *args, "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, **tokens.env(), "PYTHONUNBUFFERED": "1"}
    if cpus is not None:
        cmd = ["taskset", "-c", ",".join(map(str, sorted(cpus))), *cmd]
        env["OMP_NUM_THREADS"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    target, begin = f"127.0.0.1:{port}", time.monotonic()
    try:
        wait_serving(target, timeout=timeout_s, proc=proc)
    except (TimeoutError, RuntimeError) as exc:
        proc.kill()
        proc.wait()
        hint = f" ({COMPILE_HINT}; --startup-timeout)" if isinstance(exc, TimeoutError) and args[0] == "worker" else ""
        raise RuntimeError(f"{what or args[0]} on {target}: {exc}{hint}; the end of its log ({log}):\n"
                           f"{tail(log)}") from None  # fmt: skip
    return Started(proc, target, time.monotonic() - begin, log)


# what a worker logs once its decode steps run compiled, or once it has given up compiling (glm5_worker.engine):
# it serves eagerly meanwhile (since 5d0a68b), and the compile takes its CPU from whatever runs beside it
COMPILED = ("decode steps now run compiled", "no compiled decode steps")


def wait_compiled(worker: Started, timeout_s: float) -> tuple[float, str]:
    """Until the worker's log says its decode steps run compiled (or never will): (seconds since it served, that
    line). Fails with the end of its log after `timeout_s`."""
    begin = time.monotonic()
    while time.monotonic() - begin < timeout_s:
        for line in worker.log.read_text(errors="replace").splitlines():
            if any(marker in line for marker in COMPILED):
                return time.monotonic() - begin, line.split(": ", 1)[-1]
        if worker.proc.poll() is not None:
            raise RuntimeError(f"the worker on {worker.target} exited with {worker.proc.returncode} while compiling; "
                               f"the end of its log ({worker.log}):\n{tail(worker.log)}")  # fmt: skip
        time.sleep(0.5)
    raise RuntimeError(f"the worker on {worker.target} did not finish compiling its decode steps in {timeout_s:.0f} s "
                       f"({COMPILE_HINT}); the end of its log ({worker.log}):\n{tail(worker.log)}")  # fmt: skip


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
