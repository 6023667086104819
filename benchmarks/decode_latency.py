"""One user's decode latency: time per generated token at batch 1 after a 1K-token context, offline (the engine)
and through `glm5 serve` (HTTP streaming, one client), and where a decode step's time goes (issue 20).

The model is `glm5 init-model --preset tiny-dsa64` (the tiny model with the attention geometry llama.cpp's GLM-DSA
port accepts: index_head_dim 64, kv_lora_rank 512, RoPE 64), float32, greedy, EOS ignored.

Usage: python benchmarks/decode_latency.py [--context 1024] [--new 128] [--runs 3] [--threads 2]
                                           [--serve] [--profile] [--llama-bench PATH --gguf FILE]
                                           [--users 8 [--llama-server PATH --gguf FILE]] [--enforce-eager]
       python benchmarks/decode_latency.py --smoke     # every part but llama.cpp's, small and eager

- offline: per-step wall time of `Engine.step()` for the decode steps (the prefill step is timed apart: its
  tokens/s, no prefix cache), with the decode steps compiled (as `glm5 worker` runs by default) and eager
  (--enforce-eager), runs interleaved;
- --serve: `glm5 serve` on the same checkpoint; a streamed /v1/completions with the same token ids; the gaps
  between SSE chunks as the client reads them (its time between tokens) and the time to the first one;
- --profile: one more offline run with the compiled step's phases timed (nested, so a part's time includes the
  parts inside it) and the ATen ops one eager decode step dispatches;
- --llama-bench PATH --gguf FILE: llama.cpp's `llama-bench -p 0 -n NEW -d CONTEXT` (and `-p CONTEXT -n 0`, its
  prefill) on the same weights converted to GGUF (docs/benchmarks.md says how), once per run right after our
  engines' runs, and the ratio run by run
  (this machine's speed drifts by more than the gap between the two within minutes);
- --users N: N users at once through `glm5 serve` (streamed /v1/completions, a different CONTEXT-token prompt
  each, fresh prompts every run so no prefix cache helps): output tokens/s over the run, time to first token,
  time between tokens; with --llama-server PATH (and --gguf) the same against llama.cpp's `llama-server -np N`
  on the same weights, runs interleaved;
- --enforce-eager: our engine eager only (no compiled engine, no compile at start-up; `glm5 serve`'s worker too);
- --smoke: offline, --profile, --serve and --users 2 (on the same `glm5 serve`) on a 128-token context, 16 new
  tokens, one run, one thread, eagerly, each table checked; llama.cpp only when its paths are given (it says so
  when it is not run).

`glm5 serve`'s worker answers only its router (a per-run internal token in its environment): the direct gRPC
hop reads the token from the worker's /proc/PID/environ (the same user's process), as
tests/integration/test_rl_cli.py does.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import http.client
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from glm5.model.model import GlmMoeDsaForCausalLM
from glm5.model.presets import init_model
from glm5_worker.config import EngineConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams

PRESET = "tiny-dsa64"


def context_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, vocab - 64) for _ in range(n)]  # clear of the special tokens at both ends


def new_engine(model: Path, eager: bool = False, fused: bool = True) -> Engine:
    """The engine as `glm5 worker` runs it: decode steps compiled at start-up unless `eager`; `fused=False`: the
    attention's input projections left as separate products (the baseline of --unfused)."""
    # no prefix cache: every run's prompt is prefilled (its tokens/s is reported), not found cached
    config = EngineConfig(model=str(model), max_model_len=4096, kv_cache_bytes=256 << 20, kv_int8_tier=False,
                          enforce_eager=eager, enable_prefix_caching=False)  # fmt: skip
    if fused:
        return Engine(config)
    fuse = GlmMoeDsaForCausalLM.fuse_input_projections
    GlmMoeDsaForCausalLM.fuse_input_projections = lambda self: 0  # type: ignore[method-assign]
    try:
        return Engine(config)
    finally:
        GlmMoeDsaForCausalLM.fuse_input_projections = fuse  # type: ignore[method-assign]


def offline(
    engine: Engine, ids: list[int], new: int, tag: str, parts: Parts | None = None
) -> tuple[float, list[float]]:
    """(prefill seconds, seconds of each decode step) for one request at batch 1; `parts` timed in decode steps."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    engine.add_request(tag, None, ids, params)
    steps: list[float] = []
    while engine.has_work:
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        if parts is not None:
            parts.on = True  # from the first decode step on
    if parts is not None:
        parts.on = False
    return steps[0], steps[1:]


def warm(engine: Engine, ids: list[int]) -> None:
    offline(engine, ids[:128], 8, "warm")


# -- where the time goes ---------------------------------------------------------------------------------------


class Parts:
    """Inclusive wall time per labelled call, for calls made while `on`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.on = False

    def wrap(self, obj: Any, attr: str, label: str) -> None:
        inner = getattr(obj, attr)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(obj, attr, timed)


def instrument(engine: Engine, model_parts: bool = True) -> Parts:
    """Wraps the engine's phases (and, eagerly, the model's parts: a compiled step does not call them)."""
    parts = Parts()
    parts.wrap(engine, "step", "step (all)")
    parts.wrap(engine.scheduler, "schedule", "engine: schedule")
    parts.wrap(engine, "_plan", "engine: plan (ids, slots, tables)")
    parts.wrap(engine.runner, "batch", "runner: batch tensors")
    parts.wrap(engine.runner, "execute", "runner: execute (batch + forward)")
    parts.wrap(engine.outputs, "process", "outputs: process (sampler, stops, detok)")
    parts.wrap(engine.sampler, "sample", "outputs: sampler")
    parts.wrap(engine.outputs, "drain", "outputs: drain")
    parts.wrap(engine.blocks, "register_full_blocks", "blocks: register")
    if not model_parts:
        return parts
    model = engine.runner.model
    for i, layer in enumerate(model.model.layers):
        attn: Any = layer.self_attn
        mlp: Any = layer.mlp
        parts.wrap(attn, "forward", "model: attention (all)")
        if attn.indexer is not None:
            parts.wrap(attn.indexer, "project", "model: indexer projections")
        parts.wrap(mlp, "forward", f"model: {'MoE' if hasattr(mlp, 'experts') else 'dense MLP'} (all)")
        if hasattr(mlp, "experts"):
            parts.wrap(mlp.gate, "forward", "model: MoE router")
            parts.wrap(mlp.experts, "forward", "model: MoE routed experts")
            parts.wrap(mlp.shared_experts, "forward", "model: MoE shared expert")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            parts.wrap(norm, "forward", "model: RMSNorm")
        del i
    parts.wrap(model.lm_head, "forward", "model: lm_head")
    for name in ("index_scores", "index_scores_flat", "topk", "sparse_mla", "dense_mla", "gather"):
        if hasattr(engine.kernels, name):
            parts.wrap(engine.kernels, name, f"kernels: {name}")
    return parts


def ops_per_decode_step(engine: Engine, ids: list[int]) -> tuple[int, list[tuple[str, int, float]]]:
    """ATen ops one decode step dispatches, and the top ones by self CPU time (name, count, microseconds)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    engine.add_request("ops", None, ids, params)
    engine.step()  # prefill
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    while engine.has_work:
        engine.step()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.count for e in events)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return total, [(e.key, e.count, e.self_cpu_time_total) for e in top]


# -- through glm5 serve ----------------------------------------------------------------------------------------


@contextmanager
def running(cmd: list[str], health: str, healthy: Callable[[Any], bool], what: str, timeout_s: float,
            env: dict[str, str] | None = None, log: Path | None = None) -> Iterator[int]:  # fmt: skip
    """A server process (its pid), once `healthy(response)` of a GET on its `health` URL; stopped on exit. Its
    output goes to `log` if given."""
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(health, timeout=2) as r:
                    if healthy(r):
                        break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{what} did not become healthy")
        yield proc.pid
    finally:
        proc.terminate()
        proc.wait(30)
        if log is not None:
            out.close()  # type: ignore[union-attr]


@contextmanager
def serve(model: Path, threads: int, eager: bool = False) -> Iterator[tuple[str, str, Worker, dict[str, int]]]:
    """(router HTTP, router gRPC) addresses of a `glm5 serve` with one worker, the worker, and the pids of its
    processes ("router": `glm5 serve` itself, which runs the router; "worker")."""
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "glm5_cli", "serve", "--model", str(model), "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), "--worker-arg=--max-model-len=4096", "--worker-arg=--kv-cache-bytes=256MiB",
           "--worker-arg=--no-kv-int8-tier", *(["--worker-arg=--enforce-eager"] if eager else [])]  # fmt: skip
    base = f"127.0.0.1:{http_port}"
    with tempfile.TemporaryDirectory() as tmp, running(cmd, f"http://{base}/health", router_ok, "glm5 serve", 900,
                                                       env, Path(tmp) / "serve.log") as pid:  # fmt: skip
        if not eager:  # the worker serves eagerly while its decode steps compile: time only the compiled steps
            wait_for_line(Path(tmp) / "serve.log", COMPILED_LINES, 900)
        with urllib.request.urlopen(f"http://{base}/health", timeout=5) as r:
            (address,) = [w["address"] for w in json.load(r)["workers"]]
        (worker_pid,) = children(pid)
        worker = Worker(address, internal_token(worker_pid))
        yield base, f"127.0.0.1:{grpc_port}", worker, {"router": pid, "worker": worker_pid}


# what a worker logs once its background compile ended (glm5_worker.engine.engine: compiled, or eager for good)
COMPILED_LINES = ("decode steps now run compiled", "no compiled decode steps")


def wait_for_line(log: Path, lines: tuple[str, ...], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if any(line in text for line in lines):
            return
        time.sleep(0.5)
    raise RuntimeError(f"none of {lines} in the server's log after {timeout_s:.0f} s:\n{text[-3000:]}")


@dataclass(frozen=True)
class Worker:
    address: str
    token: str  # the internal token every call to it needs


def internal_token(pid: int) -> str:
    """The internal token `glm5 serve` handed its worker (its environment, Linux /proc; the same user's process)."""
    from glm5_cli.serve import INTERNAL_ENV

    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        name, _, value = entry.decode(errors="replace").partition("=")
        if name == INTERNAL_ENV:
            return value
    raise RuntimeError(f"glm5 serve's worker (pid {pid}) has no {INTERNAL_ENV} in its environment")


def router_ok(response: Any) -> bool:
    return bool(json.load(response).get("status") == "ok")


def children(pid: int) -> list[int]:
    """The process's child pids (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time of a process (all its threads), or of one of its threads (Linux /proc)."""
    path = Path(f"/proc/{pid}/task/{tid}/stat") if tid is not None else Path(f"/proc/{pid}/stat")
    stat = path.read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_token_cpu(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of the serving path: the worker's main thread (its asyncio loop and gRPC writes; its
    other threads run the step), the router process, and this client process."""
    return {
        "worker: event loop thread (gRPC stream)": cpu_seconds(pids["worker"], pids["worker"]),
        "router (glm5 serve: gRPC relay, SSE)": cpu_seconds(pids["router"]),
        "client (this benchmark, reading the SSE stream)": time.process_time(),
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stream_gaps(base: str, ids: list[int], new: int) -> tuple[float, list[float]]:
    """(time to the first chunk, gaps between chunks) of a streamed completion, as the client reads them."""
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": new, "temperature": 0, "stream": True,
                       "ignore_eos": True})  # fmt: skip
    host, port = base.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    arrivals = []
    for line in resp:
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            arrivals.append(time.perf_counter())
    conn.close()
    return arrivals[0] - start, [b - a for a, b in itertools.pairwise(arrivals)]


def grpc_gaps(target: str | Worker, ids: list[int], new: int) -> tuple[float, list[float]]:
    """The same request as a gRPC stream straight from a worker (or the router's gRPC API, a `target` address):
    one hop fewer each."""
    import grpc
    from glm5.client import sampling
    from glm5.security import INTERNAL_TOKEN_METADATA
    from glm5.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

    request = worker_pb2.GenerateRequest(
        prompt_token_ids=ids, sampling=sampling(max_new_tokens=new, temperature=0, ignore_eos=True)
    )
    via_router = isinstance(target, str)
    with grpc.insecure_channel(target if isinstance(target, str) else target.address) as ch:
        if isinstance(target, str):
            stub: Any = router_pb2_grpc.RouterStub(ch)  # type: ignore[no-untyped-call]
            stream = stub.Generate(router_pb2.RouterGenerateRequest(request=request))
        else:
            stub = worker_pb2_grpc.WorkerStub(ch)  # type: ignore[no-untyped-call]
            stream = stub.Generate(request, metadata=((INTERNAL_TOKEN_METADATA, target.token),))
        start = time.perf_counter()
        arrivals = [time.perf_counter() for r in stream if (r.response if via_router else r).token_ids]
    return arrivals[0] - start, [b - a for a, b in itertools.pairwise(arrivals)]


def user_stream(base: str, ids: list[int], new: int, start: float) -> tuple[float, float, int]:
    """(first chunk, last chunk, completion tokens) of one streamed completion, in perf_counter seconds."""
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": new, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}})  # fmt: skip
    host, port = base.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first = last = 0.0
    tokens = new  # with ignore_eos every server generates max_tokens; the usage chunk confirms it where sent
    for line in resp:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            last = time.perf_counter()
            first = first or last
        if chunk.get("usage"):
            tokens = int(chunk["usage"]["completion_tokens"])
    conn.close()
    return first - start, last - start, tokens


def users(base: str, prompts: list[list[int]], new: int) -> tuple[float, list[float], list[float]]:
    """len(prompts) users streaming at once: (output tokens/s over the run, each user's time to first token,
    each user's mean time between tokens after the first)."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ids: user_stream(base, ids, new, start), prompts))
    total = sum(t for _, _, t in results)
    end = max(last for _, last, _ in results)
    return total / end, [f for f, _, _ in results], [(last - f) / max(1, t - 1) for f, last, t in results]


@contextmanager
def llama_server(path: str, gguf: str, n: int, context: int, new: int, threads: int) -> Iterator[str]:
    """llama.cpp's server on the same weights with N slots of CONTEXT + NEW tokens each."""
    port = free_port()
    cmd = [path, "-m", gguf, "-t", str(threads), "-np", str(n), "-c", str(n * (context + new + 64)), "--host",
           "127.0.0.1", "--port", str(port)]  # fmt: skip
    with running(cmd, f"http://127.0.0.1:{port}/health", lambda r: r.status == 200, "llama-server", 120):
        yield f"127.0.0.1:{port}"


def llama_bench(path: str, gguf: str, context: int, new: int, threads: int) -> tuple[float, float]:
    """llama.cpp's prompt processing speed over a `context`-token prompt and its generation speed after
    `context` tokens (tokens/s each)."""

    def tokens_per_s(*args: str) -> float:
        out = subprocess.run([path, "-m", gguf, *args, "-t", str(threads), "-o", "json"], capture_output=True,
                             text=True, check=True, timeout=1800)  # fmt: skip
        return float(json.loads(out.stdout)[0]["avg_ts"])

    return tokens_per_s("-p", str(context), "-n", "0"), tokens_per_s("-p", "0", "-n", str(new), "-d", str(context))


# -- report ----------------------------------------------------------------------------------------------------


def ms(xs: list[float], q: float = 0.5) -> float:
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--llama-bench")
    ap.add_argument("--gguf")
    ap.add_argument("--users", type=int, default=0)
    ap.add_argument("--llama-server")
    ap.add_argument("--unfused", action="store_true", help="also a compiled engine without fused input projections")
    ap.add_argument("--enforce-eager", action="store_true", help="our engine eager only (no compiled engine)")
    ap.add_argument("--smoke", action="store_true", help="offline, --profile, --serve, --users 2: small, eager")
    a = ap.parse_args()
    if (a.llama_bench or a.llama_server) and not a.gguf:
        raise SystemExit("--llama-bench and --llama-server need --gguf (the same weights converted to GGUF)")
    if a.smoke:
        a.context, a.new, a.runs, a.threads, a.enforce_eager = 128, 16, 1, 1, True
        a.profile, a.serve, a.users = True, True, 2
    torch.set_num_threads(a.threads)
    ours = "eager" if a.enforce_eager else "compiled"  # the engine compared with llama.cpp and served
    rows: dict[str, int] = collections.defaultdict(int)  # each table's rows, for --smoke
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "m", preset=PRESET, seed=0)
        start = time.perf_counter()
        engine = new_engine(model, eager=a.enforce_eager)
        compiled = engine.runner.compiled
        print(f"{ours} engine started in {time.perf_counter() - start:.1f} s "
              f"(compiling {compiled.compile_seconds if compiled else 0:.1f} s)")  # fmt: skip
        engines = {ours: engine} if a.enforce_eager else {"eager": new_engine(model, eager=True), "compiled": engine}
        if a.unfused:
            engines[f"{ours}, unfused"] = new_engine(model, eager=a.enforce_eager, fused=False)
        vocab = engine.model_config.vocab_size
        ids = context_ids(vocab, a.context)
        for e in engines.values():
            warm(e, ids)
        print(f"model {PRESET}, float32, {a.threads} threads, context {a.context}, {a.new} new tokens, greedy")
        print("\n| engine | run | prefill tok/s | decode ms/token p50 | p90 | tok/s |\n|---|---:|---:|---:|---:|---:|")
        per: dict[str, list[float]] = collections.defaultdict(list)
        # per run, back to back: our compiled engine's median ms/token and llama.cpp's (--llama-bench)
        ours_runs: list[float] = []
        llama_runs: list[float] = []
        prefills: dict[str, list[float]] = collections.defaultdict(list)  # tokens/s per run
        for run in range(a.runs):
            for name, e in engines.items():  # interleaved, so drift hits both alike
                prefill, steps = offline(e, ids, a.new, f"r{run}")
                per[name] += steps
                prefills[name].append(a.context / prefill)
                print(f"| {name} | {run + 1} | {a.context / prefill:,.0f} | {ms(steps):.2f} | {ms(steps, 0.9):.2f} | "
                      f"{1000 / ms(steps):.0f} |")  # fmt: skip
                rows["offline"] += len(steps) == a.new - 1
                if name == ours:
                    ours_runs.append(ms(steps))
            if a.llama_bench:
                pp, tps = llama_bench(a.llama_bench, a.gguf, a.context, a.new, a.threads)
                llama_runs.append(1000 / tps)
                prefills["llama.cpp"].append(pp)
                print(f"| llama.cpp | {run + 1} | {pp:,.0f} | {1000 / tps:.2f} (mean) | | {tps:.0f} |")
        all_steps = per[ours]
        offline_ms = ms(all_steps)
        if a.enforce_eager:
            print(f"\noffline median over runs: eager {offline_ms:.2f} ms/token (no compiled engine: --enforce-eager)")
        else:
            print(f"\noffline median over runs: compiled {offline_ms:.2f} ms/token, eager {ms(per['eager']):.2f} "
                  f"({ms(per['eager']) / offline_ms:.2f}x the compiled time)")  # fmt: skip
        ours_pp = sorted(prefills[ours])[a.runs // 2]
        print(f"prefill median over runs: {ours_pp:,.0f} tok/s ({ours} engine; prefill steps run eagerly)")
        if not a.llama_bench:
            print("llama.cpp: not run (--llama-bench PATH --gguf FILE runs it; docs/benchmarks.md n says how)")
        else:
            theirs_pp = sorted(prefills["llama.cpp"])[a.runs // 2]
            print(f"llama.cpp prefill median: {theirs_pp:,.0f} tok/s; ours {ours_pp / theirs_pp:.2f}x")
            ratios = sorted(ours / theirs for ours, theirs in zip(ours_runs, llama_runs, strict=True))
            llama_ms = sorted(llama_runs)[len(llama_runs) // 2]
            print(f"llama.cpp median over runs: {llama_ms:.2f} ms/token; ours / llama.cpp, run by run: "
                  f"{', '.join(f'{r:.2f}' for r in ratios)} (median {ratios[len(ratios) // 2]:.2f}x the time; "
                  f"ours faster in {sum(r < 1 for r in ratios)} of {len(ratios)} runs)")  # fmt: skip
        if a.unfused:
            unfused = ms(per[f"{ours}, unfused"])
            print(f"{ours} without fused input projections: {unfused:.2f} ms/token ({unfused / offline_ms:.2f}x)")
            del engines[f"{ours}, unfused"]
        if not a.enforce_eager:
            del engines["eager"]

        if a.profile:
            parts = instrument(engine, model_parts=a.enforce_eager)  # a compiled step calls no model part
            _, steps = offline(engine, ids, a.new, "profiled", parts)
            n = parts.calls["step (all)"]
            step_ms = 1000 * parts.seconds["step (all)"] / n
            print(f"\nparts of a decode step, averaged over {n} steps; instrumented step {step_ms:.2f} ms "
                  f"(uninstrumented {ms(all_steps):.2f}: the wrappers cost the difference)\n")  # fmt: skip
            print("| part | ms/step | calls/step |\n|---|---:|---:|")
            for label, secs in sorted(parts.seconds.items(), key=lambda kv: -kv[1]):
                print(f"| {label} | {1000 * secs / n:.3f} | {parts.calls[label] / n:.1f} |")
                rows["profile"] += 1
            total, top = ops_per_decode_step(new_engine(model, eager=True), ids)
            print(f"\nATen ops dispatched by one eager decode step: {total}\n")
            print("| op | calls | self CPU us |\n|---|---:|---:|")
            for name, count, us in top:
                print(f"| {name} | {count} | {us:.0f} |")
                rows["ops"] += 1

        if a.serve:
            hops: dict[str, list[float]] = collections.defaultdict(list)
            cpu: dict[str, float] = collections.defaultdict(float)  # CPU seconds over the SSE runs
            sse_tokens = 0
            with serve(model, a.threads, a.enforce_eager) as (base, router_grpc, worker, pids):
                clients: dict[str, Any] = {
                    # the engine offline again, interleaved with the clients: each hop is measured against
                    # the engine's time of the same minutes
                    "engine offline": lambda n: (0.0, offline(engine, ids, n, "serve")[1]),
                    "worker gRPC stream": lambda n: grpc_gaps(worker, ids, n),
                    "router gRPC stream": lambda n: grpc_gaps(router_grpc, ids, n),
                    "router HTTP SSE (/v1/completions)": lambda n: stream_gaps(base, ids, n),
                }
                for client in clients.values():
                    client(8)  # warm-up
                print("\n| client | run | TTFT ms | time between tokens p50 ms | p90 ms |\n|---|---:|---:|---:|---:|")
                for run in range(a.runs):
                    for name, client in clients.items():  # interleaved, so drift hits every hop alike
                        sse = name.startswith("router HTTP SSE")
                        if sse:
                            before = per_token_cpu(pids)
                        ttft, g = client(a.new)
                        hops[name] += g
                        if sse:
                            sse_tokens += len(g) + 1
                            for k, v in per_token_cpu(pids).items():
                                cpu[k] += v - before[k]
                        print(f"| {name} | {run + 1} | {1000 * ttft:.0f} | {ms(g):.2f} | {ms(g, 0.9):.2f} |")
                        rows["serve"] += bool(g)  # a row (a hop may merge tokens that queued: fewer gaps)
                if a.smoke:  # --users on this glm5 serve: one start-up fewer
                    rows["users"] = concurrent(model, a, vocab, base)
            print("\n| where | ms/token (median) | added by this hop |\n|---|---:|---:|")
            previous: float | None = None
            for name, g in hops.items():
                print(f"| {name} | {ms(g):.2f} | {'' if previous is None else f'{ms(g) - previous:+.2f}'} |")
                previous = ms(g)
            over = ms(hops["router HTTP SSE (/v1/completions)"]) - ms(hops["engine offline"])
            print(f"\nthrough glm5 serve (SSE) over the engine offline: {over:+.2f} ms/token")
            print("\nCPU per streamed token outside the engine's step (the SSE runs; on a host whose cores the step "
                  "keeps busy, it adds to the time between tokens):\n")  # fmt: skip
            print("| process | CPU ms/token |\n|---|---:|")
            for k, v in cpu.items():
                print(f"| {k} | {1000 * v / sse_tokens:.3f} |")

        if a.users and not a.smoke:
            rows["users"] = concurrent(model, a, vocab)
    if a.smoke:  # the tables, not the speed: every run of every engine, part and client, each at full length
        want = {"offline": a.runs, "profile": 1, "ops": 1, "serve": 4 * a.runs, "users": a.runs}
        assert all(rows[k] >= n for k, n in want.items()), dict(rows)
        print("smoke: ok")


def concurrent(model: Path, a: argparse.Namespace, vocab: int, running: str | None = None) -> int:
    """--users N: glm5 serve (started here unless `running` is its address) and llama-server with N users at once,
    runs interleaved; the rows printed."""
    printed = 0
    with contextlib.ExitStack() as stack:
        servers = {"glm5 serve": running or stack.enter_context(serve(model, a.threads, a.enforce_eager))[0]}
        if a.llama_server:
            servers["llama-server"] = stack.enter_context(
                llama_server(a.llama_server, a.gguf, a.users, a.context, a.new, a.threads)
            )
        for base in servers.values():  # warm-up
            users(base, [context_ids(vocab, 64, seed=10_000 + i) for i in range(a.users)], 8)
        rows: dict[str, list[tuple[float, list[float], list[float]]]] = collections.defaultdict(list)
        print(
            f"\n{a.users} users at once, {a.context}-token prompts (different per user and run), {a.new} tokens each\n"
        )
        print("| server | run | output tok/s | TTFT p50 ms | TTFT max ms | time between tokens p50 ms |")
        print("|---|---:|---:|---:|---:|---:|")
        for run in range(a.runs):
            prompts = [context_ids(vocab, a.context, seed=1000 * (run + 1) + i) for i in range(a.users)]
            for name, base in servers.items():  # interleaved; the same prompts for both
                tps, ttft, itl = users(base, prompts, a.new)
                rows[name].append((tps, ttft, itl))
                print(f"| {name} | {run + 1} | {tps:.0f} | {ms(ttft):.0f} | {1000 * max(ttft):.0f} | {ms(itl):.2f} |")
                printed += len(ttft) == a.users
        print("\n| server | output tok/s (median of runs) | TTFT p50 ms (all users) | time between tokens p50 ms |")
        print("|---|---:|---:|---:|")
        for name, rs in rows.items():
            tps_med = sorted(r[0] for r in rs)[len(rs) // 2]
            ttft_all = [t for r in rs for t in r[1]]
            itl_all = [t for r in rs for t in r[2]]
            print(f"| {name} | {tps_med:.0f} | {ms(ttft_all):.0f} | {ms(itl_all):.2f} |")
    return printed


if __name__ == "__main__":
    main()
