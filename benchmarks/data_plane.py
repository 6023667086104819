"""The serving path's CPU per streamed token at 1 / 16 / 64 concurrent streams (issue 37, item 6): what the
worker's event-loop thread, the worker's other non-engine threads (gRPC's), and the router process (gRPC relay,
parsing, SSE) spend per token a client reads, from /proc, and what that makes a core worth in tokens/s.

One `glm5 serve` (one worker) on a random tiny-dsa64 checkpoint; N clients at once stream /v1/completions
(different short prompts, EOS ignored, greedy, usage in the last chunk) over aiohttp from this process. The
worker's engine thread is the one the OS calls `glm5-engine` (glm5.osthread), with the OpenMP pool it started;
everything else in the worker is the serving path. A core's worth = 1000 / (CPU ms per token): the tokens/s
that part of the path could carry on one core if nothing else ran there.

Usage: python benchmarks/data_plane.py [--streams 1,16,64] [--new 256] [--prompt 32] [--runs 3]
                                      [--enforce-eager] [--threads 2]
       python benchmarks/data_plane.py --smoke   # streams 1 and 4, 16 tokens each, one run, eager
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decode_latency import PRESET, context_ids, init_model, serve

ENGINE_THREAD = "glm5-engine"  # AsyncEngine's thread, as glm5.osthread names it for the OS


def thread_seconds(pid: int, tid: int) -> float:
    """Time a thread has spent on a CPU, in nanoseconds made seconds (/proc's schedstat: stat's clock ticks are
    10 ms, too coarse for a short run)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads, grouped: "loop" (the main thread, which runs asyncio),
    "engine" (threads named ENGINE_THREAD) and "other"."""
    out: dict[str, float] = collections.defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            secs = thread_seconds(pid, int(task.name))
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
        group = "loop" if int(task.name) == pid else "engine" if comm == ENGINE_THREAD else "other"
        out[group] += secs
    return out


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    worker, router = threads_cpu(pids["worker"]), threads_cpu(pids["router"])
    return {
        "worker loop": worker["loop"],
        "worker gRPC threads": worker["other"],
        "engine": worker["engine"],
        "router loop": router["loop"],
        "router all": router["loop"] + router["other"] + router["engine"],
        "client": time.thread_time(),  # the clients run on this thread's event loop
    }


async def one_stream(session: aiohttp.ClientSession, url: str, ids: list[int], new: int) -> int:
    """Completion tokens of one streamed completion (from its usage chunk)."""
    body = {"model": "m", "prompt": ids, "max_tokens": new, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens = 0
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage")
                tokens = int(usage["completion_tokens"]) if usage else tokens
    return tokens


async def streams_at_once(base: str, prompts: list[list[int]], new: int) -> tuple[int, float]:
    """(tokens the clients read, wall seconds) of len(prompts) streams started together."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        url = f"http://{base}/v1/completions"
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one_stream(session, url, ids, new) for ids in prompts))
        return sum(tokens), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--new", type=int, default=256, help="tokens per stream")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="the worker's intra-op threads")
    ap.add_argument("--enforce-eager", action="store_true", help="the worker's steps eager (no compile at start)")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.streams, a.new, a.runs, a.enforce_eager = "1,4", 16, 1, True
    counts = [int(n) for n in a.streams.split(",")]
    rows: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "m", preset=PRESET, seed=0)
        with serve(model, a.threads, a.enforce_eager) as (base, _, _, pids):
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            asyncio.run(streams_at_once(base, [context_ids(vocab, a.prompt, seed=9)], 8))  # warm-up
            print(f"model {PRESET} ({'eager' if a.enforce_eager else 'compiled'}), {a.prompt}-token prompts, "
                  f"{a.new} tokens per stream, {a.threads} intra-op threads, one worker\n")  # fmt: skip
            print("| streams | run | tokens | output tok/s | worker loop | worker gRPC threads | router | "
                  "router loop | client | engine |")  # fmt: skip
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for run in range(a.runs):
                for n in counts:  # interleaved, so drift hits every count alike
                    prompts = [context_ids(vocab, a.prompt, seed=1000 * run + n * 10 + i) for i in range(n)]
                    before = snapshot(pids)
                    tokens, wall = asyncio.run(streams_at_once(base, prompts, a.new))
                    after = snapshot(pids)
                    assert tokens == n * a.new, f"{tokens} tokens read, {n * a.new} asked for"
                    row = {k: 1000 * (after[k] - before[k]) / tokens for k in after}
                    row["tok/s"] = tokens / wall
                    rows[n].append(row)
                    print(f"| {n} | {run + 1} | {tokens} | {row['tok/s']:.0f} | {row['worker loop']:.3f} | "
                          f"{row['worker gRPC threads']:.3f} | {row['router all']:.3f} | {row['router loop']:.3f} "
                          f"| {row['client']:.3f} | {row['engine']:.3f} |")  # fmt: skip
    print("\nCPU ms per streamed token, medians over runs (a core's worth in tokens/s in brackets):\n")
    print("| streams | output tok/s | worker loop | worker loop + gRPC threads | router |\n|---:|---:|---:|---:|---:|")
    for n, rs in rows.items():

        def med(key: str, rs: list[dict[str, float]] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        loop, worker, router = med("worker loop"), med("worker loop") + med("worker gRPC threads"), med("router all")
        print(f"| {n} | {med('tok/s'):.0f} | {loop:.3f} ({1000 / loop:,.0f}) | {worker:.3f} ({1000 / worker:,.0f}) "
              f"| {router:.3f} ({1000 / router:,.0f}) |")  # fmt: skip
    if a.smoke:
        assert all(len(rows[n]) == a.runs for n in counts), dict(rows)
        print("smoke: ok")


if __name__ == "__main__":
    main()
