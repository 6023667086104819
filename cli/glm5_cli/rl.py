"""`glm5 rl`: the RL loop on this machine: N rollout workers, the TITO gateway and the trainer as processes (the
same programs an RLJob runs in its pods), one command, clean shutdown on Ctrl-C.

    glm5 rl --model CHECKPOINT --workers 2 --steps 40 --out rl-out     (history.jsonl, summary.json, rl.png)
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path

from glm5.errors import ConfigError

from glm5_cli.serve import INTERNAL_ENV, free_port, stop_processes, wait_serving

log = logging.getLogger("glm5.rl")
ADMIN_ENV = "GLM5_ADMIN_TOKEN"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="starting checkpoint (default: the shipped demo model)")
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes (data-parallel ranks)")
    p.add_argument("--out", default="rl-out",
                   help="checkpoints, history.jsonl, summary.json and rl.png; a folder that holds an earlier run "
                   "resumes it (up to --steps in total)")  # fmt: skip
    p.add_argument("--env", default="addition", choices=["addition", "tools"],
                   help="reward environment: addition (one turn), tools (multi-turn calculator calls)")  # fmt: skip
    p.add_argument("--mode", default="async", choices=["async", "sync"])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps for the run, counting resumed ones")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-url", help="rollout buffer as a Redis stream (default: in the gateway)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra `glm5 worker` flag (repeatable)")
    p.add_argument("--trainer-arg", action="append", default=[],
                   help="extra `glm5 trainer` flag (repeatable), e.g. --trainer-arg=--eval-every=10")  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a worker may take to load")


def run(a: argparse.Namespace) -> None:
    from glm5.model.presets import default_model_path

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.workers < 1:
        raise ConfigError("--workers must be >= 1")
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
    try:
        engines = []
        for _ in range(a.workers):
            port = free_port()
            procs.append(subprocess.Popen([*python, "worker", "--model", str(model), "--host", "127.0.0.1",
                                           "--port", str(port), *admin, *internal, "--weights-root", str(out),
                                           *a.worker_arg], env=env))  # fmt: skip
            engines.append(f"127.0.0.1:{port}")
        for target, proc in zip(engines, procs, strict=True):
            wait_serving(target, proc, a.startup_timeout, "worker")
        gateway = f"127.0.0.1:{free_port()}"
        redis = ["--redis-url", a.redis_url] if a.redis_url else []
        engine_flags = [f for e in engines for f in ("--engine", e)]
        procs.append(subprocess.Popen([*python, "tito-gateway", "--host", "127.0.0.1", "--port",
                                       gateway.rpartition(":")[2], *engine_flags, *redis, *internal],
                                      env=env))  # fmt: skip
        wait_serving(gateway, procs[-1], 60, "TITO gateway")
        trainer = subprocess.Popen([*python, "trainer", "--policy", str(model), "--gateway", gateway, *engine_flags,
                                    "--checkpoint-dir", str(out), "--environment", a.env, "--mode", a.mode,
                                    "--steps", str(a.steps), "--learning-rate", str(a.learning_rate),
                                    "--seed", str(a.seed), *redis, *admin, *internal,
                                    *a.trainer_arg], env=env)  # fmt: skip
        procs.append(trainer)
        code = trainer.wait()
        if code:
            raise ConfigError(f"the trainer exited with status {code} (its log is above)")
        print(f"\nRL run written to {a.out}: summary.json, history.jsonl, rl.png; the trained policy is the last "
              f"version under {a.out}/actor_synced/", flush=True)  # fmt: skip
    finally:
        stop_processes(procs)
