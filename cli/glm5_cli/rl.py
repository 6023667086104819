"""`glm5 rl`: the RL loop on this machine: N rollout workers, the TITO gateway and the trainer as processes (the
same programs an RLJob runs in its pods), one command, clean shutdown on Ctrl-C.

    glm5 rl --model CHECKPOINT --workers 2 --steps 40 --out rl-out     (history.jsonl, summary.json, rl.png)

The workers' and the gateway's output goes to OUT/logs/ (and to this terminal until the trainer starts: after that
their lines, a weight load per step, would break the trainer's progress bar).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from glm5.errors import ConfigError

from glm5_cli.serve import INTERNAL_ENV, free_port, stop_processes, wait_serving

log = logging.getLogger("glm5.rl")
ADMIN_ENV = "GLM5_ADMIN_TOKEN"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="starting checkpoint (default: the shipped demo model)")
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes (data-parallel ranks)")
    p.add_argument("--trainer-nproc", type=int, default=1,
                   help="trainer ranks (processes): the policy sharded over them with FSDP2, as `glm5 trainer "
                   "--nproc-per-node N`")  # fmt: skip
    p.add_argument("--out", default="rl-out",
                   help="checkpoints, history.jsonl, summary.json and rl.png; a folder that holds an earlier run "
                   "resumes it (up to --steps in total)")  # fmt: skip
    p.add_argument("--env", default="addition", choices=["addition", "tools"],
                   help="reward environment: addition (one turn), tools (multi-turn calculator calls)")  # fmt: skip
    p.add_argument("--mode", default="async", choices=["async", "sync"],
                   help="async: rollouts go on while the trainer trains; sync: generate, train, push")  # fmt: skip
    p.add_argument("--steps", type=int, default=40, help="optimizer steps for the run, counting resumed ones")
    p.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="problem order and rollout sampling")
    p.add_argument("--redis-url", help="rollout buffer as a Redis stream (default: in the gateway)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra `glm5 worker` flag (repeatable)")
    p.add_argument("--trainer-arg", action="append", default=[],
                   help="extra `glm5 trainer` flag (repeatable), e.g. --trainer-arg=--eval-every=10")  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a worker may take to load")


class ChildLogs:
    """Each child's stdout and stderr, line by line, to OUT/logs/NAME.log, and to this terminal while `echo`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.echo = True
        self.pumps: list[threading.Thread] = []

    def popen(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)  # fmt: skip
        assert proc.stdout is not None
        pump = threading.Thread(target=self._pump, args=(proc.stdout, self.folder / f"{name}.log"), daemon=True)
        pump.start()
        self.pumps.append(pump)
        return proc

    def _pump(self, stream: IO[bytes], path: Path) -> None:
        with path.open("ab") as f:
            for line in iter(stream.readline, b""):
                f.write(line)
                f.flush()
                if self.echo:
                    sys.stderr.buffer.write(line)
                    sys.stderr.buffer.flush()

    def close(self) -> None:
        for pump in self.pumps:
            pump.join(timeout=5)  # the children have exited: their pipes are at EOF


def _step(message: str) -> None:
    print(f"glm5 rl: {message}", file=sys.stderr, flush=True)


def run(a: argparse.Namespace) -> None:
    from glm5.model.presets import default_model_path

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.workers < 1 or a.trainer_nproc < 1:
        raise ConfigError("--workers and --trainer-nproc must be >= 1")
    model = Path(a.model) if a.model else default_model_path()
    python = [sys.executable, "-m", "glm5_cli"]
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Weight pushes need the workers' admin token: a fresh one per run, handed to the workers and the trainer in
    # their environment (never on a command line, which `ps` shows), and loads only from the run's folder. Every
    # call to the workers needs the run's internal token, handed the same way to them, the gateway and the trainer.
    env = {**os.environ, ADMIN_ENV: secrets.token_urlsafe(32), INTERNAL_ENV: secrets.token_urlsafe(32)}
    admin = ["--admin-token-env", ADMIN_ENV]
    internal = ["--internal-token-env", INTERNAL_ENV]
    procs: list[subprocess.Popen[bytes]] = []
    logs = ChildLogs(out / "logs")
    try:
        engines = []
        _step(f"starting {a.workers} rollout worker(s) on {model.name} (a first start compiles decode steps, "
              f"minutes; --worker-arg=--enforce-eager skips it)")  # fmt: skip
        for i in range(a.workers):
            port = free_port()
            procs.append(logs.popen(f"worker-{i}", [*python, "worker", "--model", str(model), "--host", "127.0.0.1",
                                                    "--port", str(port), *admin, *internal, "--weights-root",
                                                    str(out), *a.worker_arg], env))  # fmt: skip
            engines.append(f"127.0.0.1:{port}")
        for target, proc in zip(engines, procs, strict=True):
            wait_serving(target, proc, a.startup_timeout, "worker")
        _step("workers serving; starting the TITO gateway")
        gateway = f"127.0.0.1:{free_port()}"
        redis = ["--redis-url", a.redis_url] if a.redis_url else []
        engine_flags = [f for e in engines for f in ("--engine", e)]
        procs.append(logs.popen("tito-gateway", [*python, "tito-gateway", "--host", "127.0.0.1", "--port",
                                                 gateway.rpartition(":")[2], *engine_flags, *redis, *internal],
                                env))  # fmt: skip
        wait_serving(gateway, procs[-1], 60, "TITO gateway")
        steps = f"{a.steps} steps" if a.steps else "steps until Ctrl-C"
        _step(f"starting the trainer: held-out evaluation, {steps}, evaluation again (the workers' and the "
              f"gateway's logs from now on: {a.out}/logs/)")  # fmt: skip
        logs.echo = False
        ranks = (
            ["--nproc-per-node", str(a.trainer_nproc), "--master-port", str(free_port())] if a.trainer_nproc > 1 else []
        )
        trainer = subprocess.Popen([*python, "trainer", "--policy", str(model), "--gateway", gateway, *engine_flags,
                                    "--checkpoint-dir", str(out), "--environment", a.env, "--mode", a.mode,
                                    "--steps", str(a.steps), "--learning-rate", str(a.learning_rate),
                                    "--seed", str(a.seed), *redis, *admin, *internal, *ranks,
                                    *a.trainer_arg], env=env)  # fmt: skip
        procs.append(trainer)
        code = trainer.wait()
        if code:
            raise ConfigError(f"the trainer exited with status {code} (its log is above; the workers' and the "
                              f"gateway's are in {a.out}/logs/)")  # fmt: skip
        print(f"\nRL run written to {a.out}: summary.json, history.jsonl, rl.png, logs/; the trained policy is the "
              f"last version under {a.out}/actor_synced/", flush=True)  # fmt: skip
    finally:
        stop_processes(procs)
        logs.close()
