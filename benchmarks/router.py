"""Router benchmarks (results in docs/benchmarks.md):

    python -m benchmarks.router latency   [--requests 400]     added latency, router vs the worker directly
    python -m benchmarks.router throughput [--seconds 10] [--step-ms 0] [--stream-interval 0]   streamed requests/s
    python -m benchmarks.router sm4        [--mib 64]          SM4-GCM envelope path vs the raw cipher
    python -m benchmarks.router batching   [--requests 400]    token-budget batching vs a fixed 100 ms window
    python -m benchmarks.router stream     [--tokens 2000] [--step-ms 2]   one user's long stream: router CPU per token
    python -m benchmarks.router --smoke    every one of them, small (seconds each), each table checked

Latency and throughput isolate the router: the worker is tests/helpers/scripted_worker.py (the real Worker
gRPC API streaming fixed text, 16 one-token chunks per request: all at once by default, or one per request every
--step-ms like an engine's decode step), run as its own process, as is the router; the client is this process.
Beside them runs benchmarks/bare_relay.py, a grpc.aio relay that does nothing but forward: the floor of one more
Python gRPC hop on this machine, so the router's own cost can be told from the hop's. Throughput also reports
each hop's CPU milliseconds per request (from /proc), which does not depend on how the cores happen to be
shared, and the messages a request arrived in (the router merges chunks that were ready together). The machines
are shared and noisy: medians over repeats and alternating rounds, ratios against the baseline run in the same
process.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
from glm5.client import sampling
from glm5.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from tests.helpers.procs import free_port, start_router, start_scripted_worker, stop, wait_serving

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


MESSAGES: dict[str, int] = {}  # streamed messages received per path: a hop may merge chunks that were ready together


def _caller(target: str, kind: str, stream_interval: int = 0) -> tuple[grpc.aio.Channel, Call]:
    """A channel and a one-request call against the worker ("direct") or a Router service; a call returns the
    number of tokens streamed and when the first arrived."""
    ch = grpc.aio.insecure_channel(target)
    wstub, rstub = worker_pb2_grpc.WorkerStub(ch), router_pb2_grpc.RouterStub(ch)  # type: ignore[no-untyped-call]
    ids = list(range(10, 26))
    MESSAGES.setdefault(kind, 0)

    async def count(stream: Any) -> tuple[int, float]:
        n, first, messages = 0, 0.0, 0
        async for msg in stream:
            if n == 0:
                first = time.perf_counter()
            n += len((msg if kind == "direct" else msg.response).token_ids)
            messages += 1
        MESSAGES[kind] += messages
        return n, first

    async def direct(i: int) -> tuple[int, float]:
        req = worker_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling(max_new_tokens=TOKENS),
                                         stream_interval=stream_interval)  # fmt: skip
        return await count(wstub.Generate(req))

    async def routed(i: int) -> tuple[int, float]:
        req = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
            prompt_token_ids=ids, sampling=sampling(max_new_tokens=TOKENS),
            stream_interval=stream_interval))  # fmt: skip
        return await count(rstub.Generate(req))

    return ch, direct if kind == "direct" else routed


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Stack:
    """The scripted worker, the router and the bare relay (benchmarks/bare_relay.py), each its own process;
    `targets` maps "direct" / "bare relay" / "router" to where the client sends, `pids` to the process the
    hop runs in."""

    def __init__(self, *router_flags: str, bare: bool = True, step_ms: float = 0.0) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        worker_proc, worker = start_scripted_worker(None, None, "--step-ms", str(step_ms))
        self.procs.append(worker_proc)
        self.targets = {"direct": worker}
        self.pids = {"direct": worker_proc.pid}
        if bare:
            port = free_port()
            relay = subprocess.Popen([sys.executable, "-m", "benchmarks.bare_relay", "--port", str(port), "--worker",
                                      worker], cwd=Path(__file__).resolve().parents[1])  # fmt: skip
            self.procs.append(relay)
            self.targets["bare relay"] = f"127.0.0.1:{port}"
            self.pids["bare relay"] = relay.pid
            wait_serving(self.targets["bare relay"], proc=relay)
        router_proc, router, self.http_base = start_router([worker], *router_flags)
        self.procs.append(router_proc)
        self.targets["router"] = router
        self.pids["router"] = router_proc.pid

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


def with_stack(
    fn: Callable[[Stack], Coroutine[Any, Any, None]],
    *router_flags: str,
    bare: bool = True,
    step_ms: float = 0.0,
    running: Stack | None = None,
) -> None:
    """`fn` on a new stack (stopped afterwards), or on `running`."""
    if running is not None:
        asyncio.run(fn(running))
        return
    stack = Stack(*router_flags, bare=bare, step_ms=step_ms)
    try:
        asyncio.run(fn(stack))
    finally:
        stack.close()


def latency(requests: int, repeats: int, running: Stack | None = None) -> int:
    """Prints the table; its number of rows."""
    printed = 0

    async def go(stack: Stack) -> None:
        calls = {kind: _caller(target, kind) for kind, target in stack.targets.items()}
        for _ in range(50):  # warm up channels and caches
            for _, call in calls.values():
                await call(0)
        hops = [k for k in calls if k != "direct"]
        rows: dict[str, dict[str, list[tuple[float, float]]]] = {"first token": {}, "whole stream": {}}
        for _ in range(repeats):
            runs: dict[str, list[tuple[float, float]]] = {k: [] for k in calls}
            for i in range(requests):  # interleaved, one at a time: latency, not queueing
                for kind, (_, call) in calls.items():
                    runs[kind].append(await _timed_stream(lambda i=i, call=call: call(i)))  # type: ignore[misc]
            for k, what in enumerate(rows):
                d = [x[k] for x in runs["direct"]]
                for hop in hops:
                    h = [x[k] for x in runs[hop]]
                    added = (statistics.median(h) - statistics.median(d), _pct(h, 0.99) - _pct(d, 0.99))
                    rows[what].setdefault(hop, []).append(added)
                rows[what].setdefault("direct", []).append((statistics.median(d), _pct(d, 0.99)))
        for ch, _ in calls.values():
            await ch.close()
        print(f"{repeats} repeats of {requests} sequential requests ({TOKENS} tokens each), interleaved; "
              f"ms, medians over the repeats")  # fmt: skip
        print(f"{'':<14}{'direct p50':>11}{'direct p99':>11}" + "".join(
            f"{hop + ' +p50':>18}{hop + ' +p99':>18}" for hop in hops))  # fmt: skip
        for what, by in rows.items():
            line = f"{what:<14}" + "".join(f"{statistics.median(x[j] for x in by['direct']):11.3f}" for j in (0, 1))
            for hop in hops:
                line += "".join(f"{statistics.median(x[j] for x in by[hop]):18.3f}" for j in (0, 1))
            print(line)
            nonlocal printed
            printed += 1

    with_stack(go, running=running)
    return printed


def throughput(seconds: float, concurrency: int, rounds: int, step_ms: float, stream_interval: int,
               running: Stack | None = None) -> int:  # fmt: skip
    """Prints the table; its number of rows."""
    printed = 0

    async def run(kind: str, call: Call, pids: list[int]) -> tuple[float, list[float], float]:
        """requests/s, CPU milliseconds per request of each pid, messages per request at the client."""
        done = 0
        stop_at = time.perf_counter() + seconds

        async def loop(k: int) -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                assert (await call(k))[0] == TOKENS
                done += 1

        cpu0, m0 = [_cpu_seconds(p) for p in pids], MESSAGES[kind]
        t = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        rate = done / (time.perf_counter() - t)
        cpu = [(_cpu_seconds(p) - c) * 1000 / max(done, 1) for p, c in zip(pids, cpu0, strict=True)]
        return rate, cpu, (MESSAGES[kind] - m0) / max(done, 1)

    async def go(stack: Stack) -> None:
        calls = {kind: _caller(target, kind, stream_interval) for kind, target in stack.targets.items()}
        got: dict[str, list[tuple[float, list[float], float]]] = {k: [] for k in calls}
        for _ in range(rounds):  # alternating, so machine noise hits every path alike
            for kind, (_, call) in calls.items():
                pids = [stack.pids["direct"]] + ([stack.pids[kind]] if kind != "direct" else [])
                got[kind].append(await run(kind, call, pids))
        for ch, _ in calls.values():
            await ch.close()
        clock = f"one token per request every {step_ms:g} ms (an engine step)" if step_ms else "all tokens at once"
        print(f"concurrency {concurrency}, {rounds} alternating rounds of {seconds:.0f}s, {TOKENS} streamed tokens per "
              f"request, {clock}; medians (worker, hop and client share this machine's cores)")  # fmt: skip
        print(f"{'path':<12}{'req/s':>8}{'x direct':>10}{'worker CPU ms/req':>19}{'hop CPU ms/req':>16}"
              f"{'msgs/req':>10}")  # fmt: skip
        direct = statistics.median(r for r, _, _ in got["direct"])
        for kind, rows in got.items():
            rate = statistics.median(r for r, _, _ in rows)
            worker_ms = statistics.median(c[0] for _, c, _ in rows)
            hop = f"{statistics.median(c[1] for _, c, _ in rows):16.2f}" if kind != "direct" else f"{'':>16}"
            msgs = statistics.median(m for _, _, m in rows)
            print(f"{kind:<12}{rate:8.0f}{rate / direct:9.2f}x{worker_ms:19.2f}{hop}{msgs:10.1f}")
            nonlocal printed
            printed += rate > 0

    with_stack(go, step_ms=step_ms, running=running)
    return printed


def stream(tokens: int, step_ms: float, rounds: int, running: Stack | None = None) -> int:
    """One user: a stream of `tokens` tokens, one every `step_ms` (a decode step's clock), through the router's
    gRPC API and through its HTTP API (SSE, what an OpenAI client reads), alternating. What one token costs the
    router in CPU is what it takes from the engine on a host with few cores (docs/benchmarks.md n). Returns the
    table's number of rows."""
    import http.client
    import json

    printed = 0

    def grpc_stream(target: str) -> tuple[int, list[float]]:
        request = worker_pb2.GenerateRequest(prompt_token_ids=list(range(10, 26)),
                                             sampling=sampling(max_new_tokens=tokens))  # fmt: skip
        with grpc.insecure_channel(target) as ch:
            stub = router_pb2_grpc.RouterStub(ch)  # type: ignore[no-untyped-call]
            call = stub.Generate(router_pb2.RouterGenerateRequest(request=request))
            arrivals = [time.perf_counter() for r in call if r.response.token_ids]
        return len(arrivals), arrivals

    def sse_stream(base: str) -> tuple[int, list[float]]:
        host, _, port = base.removeprefix("http://").removesuffix("/v1").partition(":")
        body = json.dumps({"model": "glm5-scripted", "prompt": "x", "max_tokens": tokens, "stream": True})
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        arrivals = [time.perf_counter() for line in resp if line.startswith(b"data: {")]
        conn.close()
        return len(arrivals), arrivals

    async def go(stack: Stack) -> None:
        paths: dict[str, Callable[[], tuple[int, list[float]]]] = {
            "router gRPC": lambda: grpc_stream(stack.targets["router"]),
            "router HTTP SSE": lambda: sse_stream(stack.http_base),
        }
        for fn in paths.values():
            fn()  # warm up
        got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in paths}
        for _ in range(rounds):
            for kind, fn in paths.items():
                router0, worker0 = _cpu_seconds(stack.pids["router"]), _cpu_seconds(stack.pids["direct"])
                n, arrivals = await asyncio.to_thread(fn)
                router_us = (_cpu_seconds(stack.pids["router"]) - router0) * 1e6 / n
                worker_us = (_cpu_seconds(stack.pids["direct"]) - worker0) * 1e6 / n
                gaps = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
                got[kind].append((router_us, worker_us, statistics.median(gaps)))
        print(f"one stream of {tokens} tokens, one every {step_ms:g} ms (scripted worker), {rounds} alternating "
              f"rounds; medians")  # fmt: skip
        print(f"{'path':<18}{'router CPU us/token':>21}{'worker CPU us/token':>21}{'gap p50 ms':>12}")
        for kind, rows in got.items():
            r, w, g = (statistics.median(x[i] for x in rows) for i in range(3))
            print(f"{kind:<18}{r:21.0f}{w:21.0f}{g:12.2f}")
            nonlocal printed
            printed += 1

    with_stack(go, bare=False, step_ms=step_ms, running=running)
    return printed


def sm4(mib: int, chunk_kib: int) -> int:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from glm5.crypto.envelopes import open_stream_message, seal_message
    from glm5.crypto.sm4 import KeyRing, StreamOpener

    key = os.urandom(16)
    ring = KeyRing({"k": key})
    payload = os.urandom(chunk_kib << 10)
    n = (mib << 20) // len(payload)
    msg = router_pb2.RouterGenerateResponse(response=worker_pb2.GenerateResponse(text=payload.hex()[: len(payload)]))
    size: int = msg.ByteSize()

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
            env = seal_message(ring, msg, "req", i + 1, purpose="response")
            open_stream_message(opener, env, router_pb2.RouterGenerateResponse) if i % 2 == 0 else None
            if i % 2:
                opener.next_sequence += 1
        return n * size / (time.perf_counter() - t) / (1 << 20)

    def envelope_seal_only() -> float:
        t = time.perf_counter()
        for i in range(n):
            seal_message(ring, msg, "req", i + 1, purpose="response")
        return n * size / (time.perf_counter() - t) / (1 << 20)

    rows = [(raw(), envelope_seal_only()) for _ in range(5)]
    r = statistics.median(x[0] for x in rows)
    e = statistics.median(x[1] for x in rows)
    print(f"{chunk_kib} KiB messages, {mib} MiB per run, median of 5 interleaved runs, one core:")
    print(f"  raw SM4-GCM (cryptography):          {r:7.1f} MiB/s")
    print(f"  envelope seal (serialise + seal):     {e:7.1f} MiB/s  ({e / r:.1%} of raw)")
    del envelope
    return 2


def batching(requests: int, rate: float) -> int:
    """Open-loop arrivals (Poisson, `rate`/s) against the router: token-budget batching with a short max wait
    (the default) vs a fixed 100 ms window (--max-wait-ms 100 and a budget nobody reaches)."""

    async def go(router: str) -> tuple[float, float]:
        ch = grpc.aio.insecure_channel(router)
        stub = router_pb2_grpc.RouterStub(ch)  # type: ignore[no-untyped-call]
        import random

        rng = random.Random(0)
        lat: list[float] = []

        async def one() -> None:
            req = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
                prompt_token_ids=list(range(10, 26)), sampling=sampling(max_new_tokens=TOKENS)))  # fmt: skip
            t = time.perf_counter()
            n = sum([len(r.response.token_ids) async for r in stub.Generate(req)])
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
        async def fn(stack: Stack) -> None:
            results[label] = await go(stack.targets["router"])

        with_stack(fn, *flags, bare=False)

    run("token budget 8192 / max wait 5 ms (default)")
    run("fixed 100 ms window", "--max-wait-ms", "100", "--token-budget", "100000000", "--no-idle-flush")
    print(f"{requests} requests, Poisson arrivals at {rate:.0f}/s, {TOKENS} tokens each:")
    print(f"{'policy':<46}{'mean ms':>10}{'p99 ms':>10}")
    for label, (mean, p99) in results.items():
        print(f"{label:<46}{mean:10.2f}{p99:10.2f}")
    return len(results)


def smoke() -> None:
    """Every benchmark above, small; each must print its whole table (not a speed). Latency, throughput and stream
    share one stack (the scripted worker sending a token per request every millisecond): two start-ups fewer."""
    stack = Stack(step_ms=1.0)
    try:
        assert latency(20, 1, stack) == 2
        assert throughput(1.0, 8, 1, 1.0, 0, stack) == 3
        assert stream(100, 1.0, 1, stack) == 2
    finally:
        stack.close()
    assert sm4(1, 16) == 2
    assert batching(20, 50) == 2
    print("smoke: ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="every benchmark, small, each table checked")
    sub = parser.add_subparsers(dest="what")
    p = sub.add_parser("latency")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("throughput")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=0.0, help="the worker's step clock (0: all tokens at once)")
    p.add_argument("--stream-interval", type=int, default=0, help="tokens per message the requests ask for")
    p = sub.add_parser("sm4")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--chunk-kib", type=int, default=16)
    p = sub.add_parser("batching")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rate", type=float, default=50)
    p = sub.add_parser("stream")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    if a.smoke:
        smoke()
    elif a.what is None:
        parser.error("a benchmark (latency, throughput, sm4, batching, stream) or --smoke")
    elif a.what == "latency":
        latency(a.requests, a.repeats)
    elif a.what == "throughput":
        throughput(a.seconds, a.concurrency, a.rounds, a.step_ms, a.stream_interval)
    elif a.what == "stream":
        stream(a.tokens, a.step_ms, a.rounds)
    elif a.what == "sm4":
        sm4(a.mib, a.chunk_kib)
    else:
        batching(a.requests, a.rate)
