"""Asynchronous vs synchronous RL loop: wall time for the same number of trained samples on CPU (results in
docs/benchmarks.md; target: async >= 1.5x faster).

    python -m benchmarks.rl_loop [--model DIR] [--workers 1] [--steps 40] [--rounds 3] [--modes sync async]
                                 [--producer-cpu 1] [--no-pin] [--enforce-eager] [--startup-timeout 900]
    python -m benchmarks.rl_loop --smoke      # 2 steps of 2 groups, one round, eager workers: the whole path

Both loops run the same trainer (transformers' model, the IS loss, a weight sync after every step; in this
process) against the same `glm5 worker` processes behind a `glm5 tito-gateway` process, alternating sync and
async runs `rounds` times; each run starts from the same checkpoint. As in a real job, rollout and training get
their own devices: with pinning (default) the workers and the gateway run on CPU 0 and the trainer on CPU 1,
one thread each, and the asynchronous loop's rollout producer (the environments) on `--producer-cpu` (on a
2-core machine every process would otherwise compete for the same cores, and there would be no idle device
for the asynchronous loop to fill). sync: generate a batch, wait for all of it, train, sync. async: a producer
keeps `--inflight` groups generating while the trainer trains and syncs, samples up to `--staleness` versions
old are used (the importance-sampling loss corrects them). The time is the loop only: no evaluation, and the
producer process is started and connected before the clock starts (as environment servers are, once per job).
Medians over rounds; the ratio is sync / async.

The workers are started as `glm5 rl` starts them: a fresh admin token and internal token in their environment
(`--admin-token-env`, `--internal-token-env`; the gateway gets the internal one, the trainer both) and weight
loads only from under this run's folder (`--weights-root`). Like `glm5 rl`'s, they compile their decode steps at
start-up, serving eagerly meanwhile; the benchmark waits for each one's compiled steps before the first round
(the compile would take the rollout CPU from it), up to `--startup-timeout` (minutes on a cold cache with one pinned
thread; `--enforce-eager` skips it), prints how long it took, and fails with the end of the worker's log after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from glm5.model.presets import default_model_path
from glm5_trainer.config import RLConfig
from glm5_trainer.loop import RLRun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._launch import Started, Tokens, start, wait_compiled
from tests.helpers.procs import stop

KEYS = ("wait_seconds", "step_seconds", "publish_seconds", "sync_seconds")


async def bench(a: argparse.Namespace, root: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    pin = a.pin and len(cpus) >= 2
    if pin:  # rollout device: the first CPU; training device: the second (this process runs the trainer)
        os.sched_setaffinity(0, {cpus[1]})
        torch.set_num_threads(1)
    rollout = {cpus[0]} if pin else None
    tokens = Tokens.fresh()
    runs = root / "runs"  # every run's checkpoints: the only folder the workers load weights from
    runs.mkdir()
    worker = ["worker", "--model", str(a.model), "--max-model-len", "256", "--kv-cache-bytes", "64MiB",
              *tokens.worker_flags(runs), *(["--enforce-eager"] if a.enforce_eager else [])]  # fmt: skip
    procs: list[Started] = []
    try:
        # one at a time: two workers compiling at once on one pinned CPU would each take twice as long
        for i in range(a.workers):
            procs.append(start(worker, tokens, root / "logs" / f"worker-{i}.log", a.startup_timeout, rollout))
            if a.enforce_eager:
                print(f"worker {i} serving after {procs[-1].seconds:.1f} s (eager)", flush=True)
                continue
            # it serves eagerly while its decode steps compile on its CPU: the clock waits for them
            seconds, line = wait_compiled(procs[-1], a.startup_timeout)
            print(f"worker {i} serving after {procs[-1].seconds:.1f} s, compiled {seconds:.1f} s later ({line})",
                  flush=True)  # fmt: skip
        engines = tuple(p.target for p in procs)
        gateway = ["tito-gateway", *(f for e in engines for f in ("--engine", e)), *tokens.internal_flags()]
        procs.append(start(gateway, tokens, root / "logs" / "tito-gateway.log", 60, rollout))
        await rounds(a, procs[-1].target, engines, tokens, runs, cpus if pin else None)
    finally:
        for p in procs:
            stop(p.proc)


async def rounds(a: argparse.Namespace, gateway: str, engines: tuple[str, ...], tokens: Tokens, runs: Path,
                 cpus: list[int] | None) -> None:  # fmt: skip
    times: dict[str, list[float]] = {"sync": [], "async": []}
    stale: list[int] = []
    phases: dict[str, dict[str, list[float]]] = {m: {k: [] for k in KEYS} for m in times}
    samples = a.steps * a.groups_per_step * a.group_size
    for r in range(a.rounds):
        for mode in a.modes:
            with tempfile.TemporaryDirectory(dir=runs) as out:
                config = RLConfig(
                    policy=a.model, gateway=gateway, out=Path(out), engines=engines, mode=mode,
                    steps=a.steps, group_size=a.group_size, groups_per_step=a.groups_per_step,
                    max_inflight_groups=a.inflight, learning_rate=1e-4, staleness_limit=a.staleness,
                    eval_size=0, seed=r, progress=False, producer_cpus=(cpus[a.producer_cpu],) if cpus else (),
                    admin_token=tokens.admin, internal_token=tokens.internal,
                )  # fmt: skip
                result = await RLRun(config).run()
            if result.trained_samples != samples or result.counters.get("push_failed"):
                raise RuntimeError(f"round {r} {mode}: {result.trained_samples} of {samples} samples trained, "
                                   f"counters {result.counters}")  # fmt: skip
            times[mode].append(result.train_seconds)
            for key in KEYS:
                phases[mode][key].append(statistics.median(row[key] or 0.0 for row in result.history))
            if mode == "async":
                stale.append(result.counters.get("dropped_stale", 0))
            print(f"round {r} {mode:5s}: {result.trained_samples} samples in {result.train_seconds:6.1f}s "
                  f"({result.trained_samples / result.train_seconds:5.1f} samples/s)", flush=True)  # fmt: skip
    wall = {m: statistics.median(t) for m, t in times.items() if t}
    where = "pinned: workers on one CPU, trainer on another" if cpus else "unpinned"
    workers = "eager" if a.enforce_eager else "compiled decode steps"
    print(f"\n{where}; {a.workers} workers ({workers}), {a.steps} steps x {a.groups_per_step} groups x "
          f"{a.group_size} rollouts = {samples} trained samples, {a.rounds} rounds, medians\n")  # fmt: skip
    print("| loop | wall time (s) | trained samples/s | per step (ms): wait for rollouts / train / publish / push |")
    print("|---|---:|---:|---|")
    for mode, t in wall.items():
        cells = " / ".join(f"{statistics.median(phases[mode][k]) * 1000:.0f}" for k in KEYS)
        print(f"| {'synchronous' if mode == 'sync' else 'asynchronous'} | {t:.1f} | {samples / t:.1f} | {cells} |")
    if len(wall) == 2:
        ratios = ", ".join(f"{x / y:.2f}" for x, y in zip(times["sync"], times["async"], strict=True))
        print(f"\nasync speed-up (sync / async): {wall['sync'] / wall['async']:.2f}x (per round {ratios}); "
              f"stale samples dropped per async run: {stale}")  # fmt: skip
    if a.smoke:  # the table, not the speed
        assert set(wall) == set(a.modes) and all(t > 0 for t in wall.values()), wall
        print("smoke: ok (both loops trained every sample and pushed every version)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--inflight", type=int, default=16, help="async: groups generating at once")
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["sync", "async"], choices=("sync", "async"))
    p.add_argument(
        "--producer-cpu",
        type=int,
        default=1,
        choices=(0, 1),
        help="pinned: run the async rollout producer with the rollout side (0) or the trainer (1)",
    )
    p.add_argument("--no-pin", dest="pin", action="store_false", help="let every process use every CPU")
    p.add_argument("--enforce-eager", action="store_true", help="workers skip compiling their decode steps")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds a worker may take to serve, and then to compile its decode steps")  # fmt: skip
    p.add_argument("--smoke", action="store_true",
                   help="2 steps of 2 groups of 4, one round, eager workers: the whole path in seconds")  # fmt: skip
    a = p.parse_args()
    if a.smoke:
        a.steps, a.groups_per_step, a.group_size, a.inflight, a.rounds, a.enforce_eager = 2, 2, 4, 4, 1, True
    a.model = a.model or default_model_path()
    with tempfile.TemporaryDirectory(prefix="glm5-rl-bench-") as root:
        asyncio.run(bench(a, Path(root)))


if __name__ == "__main__":
    main()
