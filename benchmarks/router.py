"""Router benchmarks (results in docs/benchmarks.md):

    python -m benchmarks.router latency   [--requests 400]     added latency, router vs the worker directly
    python -m benchmarks.router throughput [--seconds 10]      streamed requests/s (16 tokens each)
    python -m benchmarks.router sm4        [--mib 64]          SM4-GCM envelope path vs the raw cipher
    python -m benchmarks.router batching   [--requests 400]    token-budget batching vs a fixed 100 ms window

Latency and throughput isolate the router: the worker is tests/helpers/scripted_worker.py (the real Worker
gRPC API streaming fixed text, 16 chunks per request), run as its own process, as is the router; the client
is this process. The machines are shared and noisy: medians over repeats, ratios against the baseline run in
the same process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from glm5.client import sampling
from glm5.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from tests.helpers.procs import start_router, start_scripted_worker, stop

TOKENS = 16


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _timed_stream(call: Callable[[], Awaitable[tuple[int, float]]]) -> tuple[float, float]:
    """(time to first token, time to the last one), milliseconds."""
    t = time.perf_counter()
    n, first = await call()
    assert n == TOKENS, n
    return (first - t) * 1000, (time.perf_counter() - t) * 1000


Call = Callable[[int], Awaitable[tuple[int, float]]]


def _callers(worker: str, router: str) -> tuple[grpc.aio.Channel, grpc.aio.Channel, Call, Call]:
    wch, rch = grpc.aio.insecure_channel(worker), grpc.aio.insecure_channel(router)
    wstub, rstub = worker_pb2_grpc.WorkerStub(wch), router_pb2_grpc.RouterStub(rch)
    ids = list(range(10, 26))

    async def count(stream: Any) -> tuple[int, float]:
        n, first = 0, 0.0
        async for _ in stream:
            if n == 0:
                first = time.perf_counter()
            n += 1
        return n, first

    async def direct(i: int) -> tuple[int, float]:
        req = worker_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling(max_new_tokens=TOKENS))
        return await count(wstub.Generate(req))

    async def routed(i: int) -> tuple[int, float]:
        req = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
            prompt_token_ids=ids, sampling=sampling(max_new_tokens=TOKENS)))  # fmt: skip
        return await count(rstub.Generate(req))

    return wch, rch, direct, routed


def with_stack(fn: Callable[[str, str], Awaitable[None]], *router_flags: str) -> None:
    worker_proc, worker = start_scripted_worker()
    router_proc, router, _ = start_router([worker], *router_flags)
    try:
        asyncio.run(fn(worker, router))
    finally:
        stop(router_proc)
        stop(worker_proc)


def latency(requests: int, repeats: int) -> None:
    async def go(worker: str, router: str) -> None:
        wch, rch, direct, routed = _callers(worker, router)
        for _ in range(50):  # warm up channels and caches
            await direct(0)
            await routed(0)
        rows: dict[str, list[tuple[float, float, float, float]]] = {"first token": [], "whole stream": []}
        for _ in range(repeats):
            d, r = [], []
            for i in range(requests):  # interleaved, one at a time: latency, not queueing
                d.append(await _timed_stream(lambda i=i: direct(i)))  # type: ignore[misc]
                r.append(await _timed_stream(lambda i=i: routed(i)))  # type: ignore[misc]
            for k, what in enumerate(rows):
                dk, rk = [x[k] for x in d], [x[k] for x in r]
                rows[what].append((statistics.median(dk), _pct(dk, 0.99), statistics.median(rk), _pct(rk, 0.99)))
        await wch.close()
        await rch.close()
        print(f"{'':<14}{'run':<5}{'direct p50 ms':>14}{'direct p99':>11}{'router p50':>11}{'router p99':>11}"
              f"{'added p50':>10}{'added p99':>10}")  # fmt: skip
        for what, runs in rows.items():
            for k, (dp50, dp99, rp50, rp99) in enumerate(runs):
                print(f"{what:<14}{k:<5}{dp50:14.3f}{dp99:11.3f}{rp50:11.3f}{rp99:11.3f}{rp50 - dp50:10.3f}"
                      f"{rp99 - dp99:10.3f}")  # fmt: skip
        print(f"\nmedians over {repeats} repeats of {requests} sequential requests ({TOKENS} tokens each):")
        for what, runs in rows.items():
            added = statistics.median(r[2] - r[0] for r in runs)
            added99 = statistics.median(r[3] - r[1] for r in runs)
            print(f"  {what:<13} router added p50 {added:.3f} ms, p99 {added99:.3f} ms")

    with_stack(go)


def throughput(seconds: float, concurrency: int) -> None:
    async def run(call: Call) -> float:
        done = 0
        stop_at = time.perf_counter() + seconds

        async def loop(k: int) -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                assert (await call(k))[0] == TOKENS
                done += 1

        t = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        return done / (time.perf_counter() - t)

    async def go(worker: str, router: str) -> None:
        wch, rch, direct, routed = _callers(worker, router)
        d = await run(direct)
        r = await run(routed)
        await wch.close()
        await rch.close()
        print(f"concurrency {concurrency}, {seconds:.0f}s each, {TOKENS} streamed tokens per request:")
        print(f"  worker directly: {d:8.0f} req/s\n  through router:  {r:8.0f} req/s  ({r / d:.2f}x of direct)")

    with_stack(go)


def sm4(mib: int, chunk_kib: int) -> None:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from glm5.crypto.envelopes import open_stream_message, seal_message
    from glm5.crypto.sm4 import KeyRing, StreamOpener

    key = os.urandom(16)
    ring = KeyRing({"k": key})
    payload = os.urandom(chunk_kib << 10)
    n = (mib << 20) // len(payload)
    msg = router_pb2.RouterGenerateResponse(response=worker_pb2.GenerateResponse(text=payload.hex()[: len(payload)]))
    size = msg.ByteSize()

    def raw() -> float:
        t = time.perf_counter()
        for _ in range(n):
            nonce = os.urandom(12)
            enc = Cipher(algorithms.SM4(key), modes.GCM(nonce)).encryptor()
            enc.authenticate_additional_data(b"req")
            enc.update(payload)
            enc.finalize()
        return n * len(payload) / (time.perf_counter() - t) / (1 << 20)

    def envelope() -> float:
        t = time.perf_counter()
        opener = StreamOpener(ring, "req")
        for i in range(n):
            env = seal_message(ring, msg, "req", i + 1)
            open_stream_message(opener, env, router_pb2.RouterGenerateResponse) if i % 2 == 0 else None
            if i % 2:
                opener.next_sequence += 1
        return n * size / (time.perf_counter() - t) / (1 << 20)

    def envelope_seal_only() -> float:
        t = time.perf_counter()
        for i in range(n):
            seal_message(ring, msg, "req", i + 1)
        return n * size / (time.perf_counter() - t) / (1 << 20)

    rows = [(raw(), envelope_seal_only()) for _ in range(5)]
    r = statistics.median(x[0] for x in rows)
    e = statistics.median(x[1] for x in rows)
    print(f"{chunk_kib} KiB messages, {mib} MiB per run, median of 5 interleaved runs, one core:")
    print(f"  raw SM4-GCM (cryptography):          {r:7.1f} MiB/s")
    print(f"  envelope seal (serialise + seal):     {e:7.1f} MiB/s  ({e / r:.1%} of raw)")
    del envelope


def batching(requests: int, rate: float) -> None:
    """Open-loop arrivals (Poisson, `rate`/s) against the router: token-budget batching with a short max wait
    (the default) vs a fixed 100 ms window (--max-wait-ms 100 and a budget nobody reaches)."""

    async def go(worker: str, router: str) -> tuple[float, float]:
        ch = grpc.aio.insecure_channel(router)
        stub = router_pb2_grpc.RouterStub(ch)
        import random

        rng = random.Random(0)
        lat: list[float] = []

        async def one() -> None:
            req = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
                prompt_token_ids=list(range(10, 26)), sampling=sampling(max_new_tokens=TOKENS)))  # fmt: skip
            t = time.perf_counter()
            n = sum([1 async for _ in stub.Generate(req)])
            assert n == TOKENS
            lat.append((time.perf_counter() - t) * 1000)

        tasks = []
        for _ in range(requests):
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        await ch.close()
        return statistics.fmean(lat), _pct(lat, 0.99)

    results: dict[str, tuple[float, float]] = {}

    def run(label: str, *flags: str) -> None:
        async def fn(worker: str, router: str) -> None:
            results[label] = await go(worker, router)

        with_stack(fn, *flags)

    run("token budget 8192 / max wait 5 ms (default)")
    run("fixed 100 ms window", "--max-wait-ms", "100", "--token-budget", "100000000", "--no-idle-flush")
    print(f"{requests} requests, Poisson arrivals at {rate:.0f}/s, {TOKENS} tokens each:")
    print(f"{'policy':<46}{'mean ms':>10}{'p99 ms':>10}")
    for label, (mean, p99) in results.items():
        print(f"{label:<46}{mean:10.2f}{p99:10.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("latency")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("throughput")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=64)
    p = sub.add_parser("sm4")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--chunk-kib", type=int, default=16)
    p = sub.add_parser("batching")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rate", type=float, default=50)
    a = parser.parse_args()
    if a.what == "latency":
        latency(a.requests, a.repeats)
    elif a.what == "throughput":
        throughput(a.seconds, a.concurrency)
    elif a.what == "sm4":
        sm4(a.mib, a.chunk_kib)
    else:
        batching(a.requests, a.rate)
    del subprocess
