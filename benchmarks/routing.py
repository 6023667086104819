"""Routing by cached prefix (issue 37, item 3): a shared-prefix, multi-turn agent workload against `glm5 serve
--workers N` in each routing mode, side by side in one run.

The workload: G groups, each with its own system prompt and tool definitions of P tokens; U users per group at
once, each holding a conversation of T turns that resends everything before (the system prompt, every earlier
user message and the model's own answers, as the token ids it returned) plus a new user message of M tokens; R
new tokens per answer (greedy, EOS ignored); no session ids. Through the router's gRPC API (prompt token ids in,
token ids out), so nothing is retokenised.

Per mode (a fresh `glm5 serve` each, so every cache starts empty): the prefix-cache hit rate the workers report
(each answer's usage.cached_prompt_tokens over its prompt tokens, summed) against the workload's ideal (a prompt's
leading blocks that any earlier request's prompt or answer holds: what one infinite cache shared by every worker
would find), time to first token p50 / p90, output tokens/s over the run, and max / mean over the workers of the
tokens each generated (from the router's /metrics) and of the requests each ran at once (sampled every 0.2 s),
and TTFT p50 per turn (turn 1 finds nothing of its own cached; every user starts at once, so a mode that ends
turn 1 together sends turn 2 together).

Usage: python benchmarks/routing.py [--model DIR] [--workers 4] [--groups 4] [--users 3] [--turns 4]
                                    [--prefix 1024] [--message 64] [--answer 32] [--modes session,load,kv]
                                    [--compiled] [--kv-cache-bytes 128MiB] [--think-ms 0]
       python benchmarks/routing.py --smoke   # 2 workers, 2 groups of 2 users, 2 turns, short prompts
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from glm5.client import sampling
from glm5.kvcache.prefix import prompt_block_hashes
from glm5.v1 import router_pb2, router_pb2_grpc, worker_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._launch import tail
from tests.helpers.procs import free_port


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    ttft_by_turn: dict[int, list[float]] = field(default_factory=dict)
    prompt: int = 0
    cached: int = 0
    ideal: int = 0
    generated: int = 0
    wall_s: float = 0.0
    work: dict[str, float] = field(default_factory=dict)  # per worker: prompt tokens computed + generated
    running: dict[str, list[float]] = field(default_factory=dict)  # per worker: sampled requests running


class Seen:
    """Every block any request so far sent or received (the ideal: one shared cache that never evicts)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: set[bytes] = set()

    def ideal(self, ids: list[int]) -> int:
        n = 0
        for h in prompt_block_hashes(ids, self.block_size):
            if h not in self.blocks:
                break
            n += 1
        return n * self.block_size

    def add(self, ids: list[int]) -> None:
        self.blocks.update(prompt_block_hashes([*ids, 0], self.block_size))  # every full block of `ids`


@contextmanager
def serving(model: Path, workers: int, routing: str, compiled: bool, log: Path,
            kv_cache_bytes: str = "128MiB") -> Iterator[tuple[str, str]]:  # fmt: skip
    """`glm5 serve --workers N --router-arg=--routing=MODE`: (gRPC target, HTTP base) once every worker is in."""
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "glm5_cli", "serve", "--model", str(model), "--workers", str(workers),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), f"--router-arg=--routing={routing}",
           "--router-arg=--stats-interval=0.2", "--worker-arg=--max-model-len=4096",
           f"--worker-arg=--kv-cache-bytes={kv_cache_bytes}", "--worker-arg=--no-kv-int8-tier"]  # fmt: skip
    if not compiled:
        cmd.append("--worker-arg=--enforce-eager")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    health = json.load(r)
                if health.get("status") == "ok" and len(health.get("workers", [])) == workers and all(
                        w.get("healthy") for w in health["workers"]):  # fmt: skip
                    break
            except (OSError, ValueError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"glm5 serve --routing {routing} did not come up; its log ({log}):\n{tail(log)}")
            time.sleep(0.5)
        yield f"127.0.0.1:{grpc_port}", base
    finally:
        proc.terminate()
        proc.wait(60)


def metrics(base: str) -> dict[str, dict[str, float]]:
    """Per worker: the router's last polled glm5_worker_* values by metric name."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for name, worker, value in re.findall(r'^(glm5_worker_[a-z_]+)\{worker="([^"]+)"\} (\S+)$', text, re.MULTILINE):
        out.setdefault(worker, {})[name] = float(value)
    return out


async def workload(target: str, base: str, a: argparse.Namespace, vocab: int, block_size: int) -> Result:
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, vocab) for _ in range(a.prefix)] for _ in range(a.groups)]
    res, seen = Result(), Seen(block_size)
    sampler_stop = asyncio.Event()

    async def sample() -> None:
        while not sampler_stop.is_set():
            for worker, values in (await asyncio.to_thread(metrics, base)).items():
                res.running.setdefault(worker, []).append(values.get("glm5_worker_requests_running", 0.0))
            await asyncio.sleep(0.2)

    async def user(stub: router_pb2_grpc.RouterStub, group: int, u: int) -> None:
        urng = random.Random(1000 * group + u)
        conversation = list(prefixes[group])
        for turn in range(a.turns):
            if a.think_ms:
                await asyncio.sleep(urng.uniform(0, a.think_ms) / 1e3)
            conversation += [urng.randrange(3, vocab) for _ in range(a.message)]
            prompt = list(conversation)
            res.ideal += seen.ideal(prompt)
            seen.add(prompt)
            request = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
                prompt_token_ids=prompt, sampling=sampling(temperature=0.0, max_new_tokens=a.answer,
                                                           ignore_eos=True)))  # fmt: skip
            start = time.perf_counter()
            answer: list[int] = []
            usage = None
            async for msg in stub.Generate(request, timeout=600):
                if not answer and msg.response.token_ids:
                    res.ttft.append(time.perf_counter() - start)
                    res.ttft_by_turn.setdefault(turn, []).append(res.ttft[-1])
                answer += msg.response.token_ids
                if msg.response.HasField("usage"):
                    usage = msg.response.usage
            assert usage is not None and usage.prompt_tokens == len(prompt), "no usage in the last message"
            res.prompt += usage.prompt_tokens
            res.cached += usage.cached_prompt_tokens
            res.generated += len(answer)
            conversation += answer
            seen.add(conversation)

    before = metrics(base)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = router_pb2_grpc.RouterStub(channel)  # type: ignore[no-untyped-call]
        sampler = asyncio.create_task(sample())
        start = time.perf_counter()
        await asyncio.gather(*(user(stub, g, u) for g in range(a.groups) for u in range(a.users)))
        res.wall_s = time.perf_counter() - start
        sampler_stop.set()
        await sampler
    await asyncio.sleep(0.6)  # the router's next poll of every worker
    after = metrics(base)
    for worker, values in after.items():
        was = before.get(worker, {})
        res.work[worker] = values.get("glm5_worker_generated_tokens_total", 0.0) - was.get(
            "glm5_worker_generated_tokens_total", 0.0)  # fmt: skip
    return res


def model_info(model: Path) -> tuple[int, int]:
    config = json.loads((model / "config.json").read_text())
    return int(config["vocab_size"]), 64  # the worker's default --block-size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="checkpoint (default: glm5 init-model --preset tiny, written here)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4, help="system prompts (each with its users)")
    ap.add_argument("--users", type=int, default=3, help="concurrent users per group")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--prefix", type=int, default=1024, help="tokens of each group's system prompt and tools")
    ap.add_argument("--message", type=int, default=64, help="tokens of each user message")
    ap.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    ap.add_argument("--modes", default="session,load,kv", help="--routing modes to run, in this order")
    ap.add_argument("--compiled", action="store_true", help="compiled decode steps (default: eager, no compile)")
    ap.add_argument("--kv-cache-bytes", default="128MiB",
                    help="each worker's KV pool: small enough that the groups' prompts do not all fit in every "
                    "worker's cache, as on a real model's KV budget")  # fmt: skip
    ap.add_argument("--think-ms", type=float, default=0.0,
                    help="each user pauses a random 0..N ms before each turn (an agent running its tools); 0: "
                    "every user sends its next turn the moment its answer ends")  # fmt: skip
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.workers, a.groups, a.users, a.turns, a.prefix, a.message, a.answer = 2, 2, 2, 2, 192, 64, 8
    work = Path(tempfile.mkdtemp(prefix="glm5-routing-bench-"))
    model = a.model
    if model is None:
        from glm5.model.presets import init_model

        model = init_model(work / "tiny", preset="tiny", seed=0)
    vocab, block_size = model_info(model)
    modes = a.modes.split(",")
    print(f"{a.workers} workers ({'compiled' if a.compiled else 'eager'}), {a.groups} groups x {a.users} users x "
          f"{a.turns} turns: system prompt {a.prefix} tokens, messages {a.message}, answers {a.answer} "
          f"(block size {block_size}), think time 0..{a.think_ms:g} ms; a fresh glm5 serve per mode\n")  # fmt: skip
    rows = []
    for mode in modes:
        with serving(model, a.workers, mode, a.compiled, work / f"{mode}.log", a.kv_cache_bytes) as (target, base):
            rows.append((mode, asyncio.run(workload(target, base, a, vocab, block_size))))
    print("| routing | hit rate | ideal | vs ideal | TTFT p50 ms | TTFT p90 ms | output tok/s | max/mean generated "
          "| max/mean running | TTFT p50 by turn ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in rows:
        hit, ideal = r.cached / r.prompt, r.ideal / r.prompt
        ttft = sorted(r.ttft)
        p50, p90 = statistics.median(ttft), ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))]
        gen = list(r.work.values()) or [0.0]
        running = [statistics.fmean(v) for v in r.running.values()] or [0.0]
        by_turn = " / ".join(f"{statistics.median(v) * 1e3:.0f}" for _, v in sorted(r.ttft_by_turn.items()))
        print(f"| {mode} | {hit:.1%} | {ideal:.1%} | {hit / ideal if ideal else 0:.2f} | {p50 * 1e3:.0f} | "
              f"{p90 * 1e3:.0f} | {r.generated / r.wall_s:.0f} | "
              f"{max(gen) / statistics.fmean(gen) if statistics.fmean(gen) else 0:.2f} | "
              f"{max(running) / statistics.fmean(running) if statistics.fmean(running) else 0:.2f} | "
              f"{by_turn} |")  # fmt: skip


if __name__ == "__main__":
    main()
