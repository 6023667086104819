"""Breaker soak: one worker at saturation behind a router for a while, with the default breaker thresholds. How
often is each soft signal over its threshold on normal traffic (the share of stats samples), how high do they
get, and does the breaker ever open? (It must not: a single worker is never ejected.)

    .venv/bin/python benchmarks/breaker_soak.py --seconds 600 --clients 16      (results in docs/benchmarks.md l)
    .venv/bin/python benchmarks/breaker_soak.py --smoke      # 3 s at 2 clients, an eager 1-thread worker

The worker and the router are started as `glm5 serve` starts them: the worker answers only callers with the run's
internal token (the router and this script's stats watcher), handed over in the environment. The worker compiles
its decode steps before it serves, as by default (`--enforce-eager` skips it; `--startup-timeout` bounds it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import openai
from glm5.client import worker_stub
from glm5.model.presets import SHIPPED_MODEL
from glm5.v1 import worker_pb2
from glm5_router.config import BreakerConfig

from benchmarks._launch import Tokens, start
from tests.helpers.procs import start_router, stop

SIGNALS = {"kv_fragmentation": "kv_fragmentation", "attention_entropy_drift": "entropy_drift",
           "token_latency_jitter_ms": "token_jitter_ms"}  # fmt: skip
PROMPTS = [f"What is {a} + {b}?" for a in range(3, 90, 7) for b in range(2, 80, 9)]


async def soak(seconds: float, clients: int, base: str, worker: str, tokens: Tokens) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    model = (await client.models.list()).data[0].id
    deadline = time.monotonic() + seconds
    counts = {"ok": 0, "error": 0}
    samples: list[worker_pb2.WorkerStats] = []
    health_states: list[str] = []

    async def user(i: int) -> None:
        n = i
        while time.monotonic() < deadline:
            n += clients
            try:
                messages: Any = [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}]
                await client.chat.completions.create(model=model, max_tokens=48, temperature=0.7, messages=messages)
                counts["ok"] += 1
            except openai.APIError:
                counts["error"] += 1

    async def watch() -> None:
        async with grpc.aio.insecure_channel(worker) as ch:
            stub = worker_stub(ch, tokens.internal)
            while time.monotonic() < deadline:
                samples.append(await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5))
                with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=5) as r:
                    health_states.append(json.load(r)["workers"][0]["breaker"])
                await asyncio.sleep(0.5)

    await asyncio.gather(watch(), *(user(i) for i in range(clients)))
    limits = BreakerConfig()
    table = {}
    for field, limit_name in SIGNALS.items():
        values = [float(getattr(s, field)) for s in samples]
        limit = float(getattr(limits, limit_name))
        table[field] = {"threshold": limit, "over_share": sum(v > limit for v in values) / len(values),
                        "p50": statistics.median(values), "p99": sorted(values)[int(0.99 * (len(values) - 1))],
                        "max": max(values)}  # fmt: skip
    with urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    opened = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("glm5_router_breaker_transitions_total") and 'to="open"' in line)  # fmt: skip
    return {"requests": counts, "samples": len(samples), "signals": table, "breaker_opened": opened,
            "breaker_states_seen": sorted(set(health_states))}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--enforce-eager", action="store_true", help="the worker skips compiling its decode steps")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds the worker may take to serve")
    p.add_argument("--smoke", action="store_true", help="3 s at 2 clients, an eager one-thread worker")
    a = p.parse_args()
    if a.smoke:
        a.seconds, a.clients, a.enforce_eager = 3.0, 2, True
    tokens = Tokens.fresh()
    flags = ["--max-model-len", "1024", "--kv-cache-bytes", "64MiB", *tokens.internal_flags(),
             *(["--enforce-eager"] if a.enforce_eager else [])]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="glm5-soak-") as logs:
        worker = start(["worker", "--model", str(SHIPPED_MODEL), *flags], tokens, Path(logs) / "worker.log",
                       a.startup_timeout, threads=1 if a.smoke else None)  # fmt: skip
        print(f"worker serving after {worker.seconds:.1f} s ({'eager' if a.enforce_eager else 'compiled'})")
        try:
            router, _, base = start_router([worker.target], *tokens.internal_flags(), env=tokens.env())
            try:
                result = asyncio.run(soak(a.seconds, a.clients, base, worker.target, tokens))
            finally:
                stop(router)
        finally:
            stop(worker.proc)
    print(f"{a.seconds:.0f} s at {a.clients} clients on one worker: {result['requests']}, "
          f"{result['samples']} stats samples, breaker opened {result['breaker_opened']:.0f} times, "
          f"states seen {result['breaker_states_seen']}")  # fmt: skip
    print(f"{'signal':<26}{'threshold':>10}{'over':>8}{'p50':>10}{'p99':>10}{'max':>10}")
    for name, row in result["signals"].items():
        print(f"{name:<26}{row['threshold']:>10g}{row['over_share']:>8.1%}{row['p50']:>10.3f}{row['p99']:>10.3f}"
              f"{row['max']:>10.3f}")  # fmt: skip
    if a.smoke:  # the table, not the figures: requests served and every signal sampled
        assert result["requests"]["ok"] > 0 and result["samples"] > 0 and len(result["signals"]) == 3, result
        print("smoke: ok")


if __name__ == "__main__":
    main()
