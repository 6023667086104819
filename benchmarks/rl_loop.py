"""Asynchronous vs synchronous RL loop: wall time for the same number of trained samples on CPU (results in
docs/benchmarks.md; target: async >= 1.5x faster).

    python -m benchmarks.rl_loop [--model DIR] [--workers 1] [--steps 40] [--rounds 3] [--modes sync async]
                                 [--producer-cpu 1] [--no-pin]

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
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from glm5.model.presets import default_model_path
from glm5_trainer.loop import RLConfig, RLRun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.procs import free_port, stop, wait_serving


def start(args: list[str], cpus: set[int] | None) -> tuple[subprocess.Popen[bytes], str]:
    """`glm5 ARGS --port P` on these CPUs, one thread."""
    port = free_port()
    cmd = [sys.executable, "-m", "glm5_cli", *args, "--host", "127.0.0.1", "--port", str(port)]
    env = os.environ.copy()
    if cpus is not None:
        cmd = ["taskset", "-c", ",".join(map(str, sorted(cpus))), *cmd]
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    target = f"127.0.0.1:{port}"
    wait_serving(target, proc=proc)
    return proc, target


async def bench(a: argparse.Namespace) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    pin = a.pin and len(cpus) >= 2
    if pin:  # rollout device: the first CPU; training device: the second (this process runs the trainer)
        os.sched_setaffinity(0, {cpus[1]})
        torch.set_num_threads(1)
    rollout = {cpus[0]} if pin else None
    worker = ["worker", "--model", str(a.model), "--max-model-len", "256", "--kv-cache-bytes", "64MiB"]
    procs = [start(worker, rollout) for _ in range(a.workers)]
    engines = tuple(t for _, t in procs)
    procs.append(start(["tito-gateway", *(f for e in engines for f in ("--engine", e))], rollout))
    gateway = procs[-1][1]
    times: dict[str, list[float]] = {"sync": [], "async": []}
    stale: list[int] = []
    keys = ("wait_seconds", "step_seconds", "publish_seconds", "sync_seconds")
    phases: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in times}
    try:
        for r in range(a.rounds):
            for mode in a.modes:
                with tempfile.TemporaryDirectory() as out:
                    config = RLConfig(
                        policy=a.model, gateway=gateway, out=Path(out), engines=engines, mode=mode,
                        steps=a.steps, group_size=a.group_size, groups_per_step=a.groups_per_step,
                        max_inflight_groups=a.inflight, learning_rate=1e-4, staleness_limit=a.staleness,
                        eval_size=0, seed=r, progress=False,
                        producer_cpus=(cpus[a.producer_cpu],) if pin else (),
                    )  # fmt: skip
                    result = await RLRun(config).run()
                times[mode].append(result.train_seconds)
                for key in keys:
                    phases[mode][key].append(statistics.median(row[key] or 0.0 for row in result.history))
                if mode == "async":
                    stale.append(result.counters.get("dropped_stale", 0))
                print(f"round {r} {mode:5s}: {result.trained_samples} samples in {result.train_seconds:6.1f}s "
                      f"({result.trained_samples / result.train_seconds:5.1f} samples/s)", flush=True)  # fmt: skip
    finally:
        for p, _ in procs:
            stop(p)
    samples = a.steps * a.groups_per_step * a.group_size
    wall = {m: statistics.median(t) for m, t in times.items() if t}
    where = "pinned: workers on one CPU, trainer on another" if pin else "unpinned"
    print(f"\n{where}; {a.workers} workers, {a.steps} steps x {a.groups_per_step} groups x {a.group_size} rollouts "
          f"= {samples} trained samples, {a.rounds} rounds, medians\n")  # fmt: skip
    print("| loop | wall time (s) | trained samples/s | per step (ms): wait for rollouts / train / publish / push |")
    print("|---|---:|---:|---|")
    for mode, t in wall.items():
        cells = " / ".join(f"{statistics.median(phases[mode][k]) * 1000:.0f}" for k in keys)
        print(f"| {'synchronous' if mode == 'sync' else 'asynchronous'} | {t:.1f} | {samples / t:.1f} | {cells} |")
    if len(wall) == 2:
        rounds = ", ".join(f"{x / y:.2f}" for x, y in zip(times["sync"], times["async"], strict=True))
        print(f"\nasync speed-up (sync / async): {wall['sync'] / wall['async']:.2f}x (per round {rounds}); "
              f"stale samples dropped per async run: {stale}")  # fmt: skip


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
    a = p.parse_args()
    a.model = a.model or default_model_path()
    asyncio.run(bench(a))


if __name__ == "__main__":
    main()
