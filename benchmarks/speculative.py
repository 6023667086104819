"""Speculative decoding (issue 36): per-token time at batch 1 with k = 0..3 draft tokens, in one process.

Batch 1: `--questions` held-out tool problems in turn (tools written in ways the model never saw; the longest
prompts, ~190 tokens: the demo model was trained on episodes of a few hundred tokens and answers longer chats
badly), the model's first turn (thinking and a call) to its end, greedy: milliseconds per generated token after
the first (the decode phase), milliseconds per engine step (a step verifies the sequence and its k drafts as
k + 1 rows), the mean accepted length (tokens a verify step emits) and the acceptance rate, for prompt lookup
(ngram) and, when the checkpoint has an MTP layer, mtp. Then throughput (generated tokens over wall time, `--new`
tokens each after a `--context`-token few-shot prompt, EOS ignored, medians of interleaved runs) at larger
batches, without speculation, with it, and with `disable_by_batch_size` turning it off above a batch size.
Greedy tokens are compared with the run without speculation (the share of sequences with every token equal).

--serve: the same batch-1 questions through `glm5 serve` (one worker each, its steps as offline), one server
without speculation and one per k of the last method, all up at once and asked in turn (interleaved runs): a
streamed /v1/completions per question (the prompt's token ids, greedy, to its end), milliseconds per token after
the first chunk as the client reads them, and whether each answer's text equals the server's without
speculation. The workers compile into the offline runs' cache, so they start warm.

Usage: python benchmarks/speculative.py [--model DIR] [--context 1024] [--questions 6] [--new 64] [--k 1,2,3] [--runs 3]
                                        [--batches 1,2,4,8,32] [--disable-by-batch-size 1] [--enforce-eager]
                                        [--serve]
       python benchmarks/speculative.py --smoke    # 128-token context, 16 new tokens, k 1 and 3, eager, --serve
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from glm5.model.presets import default_model_path
from glm5.tokenizer.tokenizer import Tokenizer
from glm5_trainer.environment import prompt_ids
from glm5_trainer.tool_family import held_out_problems
from glm5_worker.config import CPU_DISABLE_BY_BATCH_SIZE, EngineConfig, SpeculativeConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._launch import COMPILED, tail
from tests.helpers.procs import free_port


@dataclass
class Run:
    ms_per_token: float
    ms_per_step: float
    accepted_length: float  # tokens per verify step (1 + accepted drafts)
    acceptance: float
    tokens: list[list[int]]
    wall_s: float
    steps: int = 0  # decode steps
    verify_steps: int = 0  # sequence-steps that verified drafts
    accepted: int = 0
    drafted: int = 0


def context(tok: Tokenizer, length: int, index: int = 0) -> list[int]:
    """Few-shot additions up to `length` tokens, ending where the next problem starts (throughput prompts: the
    model continues them, EOS ignored)."""
    lines: list[str] = []
    ids: list[int] = []
    i = 0
    while len(ids) < length:
        a, b = (37 * (i + index) + 11) % 90 + 10, (53 * (i + 2 * index) + 7) % 97 + 3
        lines.append(f"What is {a} + {b}? The answer is {a + b}.\n")
        ids = tok.encode("".join(lines))
        i += 1
    return ids[:length]


def questions(tok: Tokenizer, n: int) -> list[list[int]]:
    """The `n` longest prompts (the question and the tools' JSON through the chat template) of the held-out tool
    problems (tools written in ways the model never saw, 1-4 digit operands): an agent's first turn."""
    problems = [p for ps in held_out_problems(per_bucket=60).values() for p in ps]
    return sorted((prompt_ids(tok, p) for p in problems), key=len)[-n:]


def engine(model: Path, spec: SpeculativeConfig | None, eager: bool, cache: Path, max_len: int) -> Engine:
    # no prefix cache: a repeated prompt would reuse blocks by then in the INT8 tier, computed (and rounded) once
    # per engine history, and its runs would differ for that reason alone
    return Engine(EngineConfig(model=str(model), max_model_len=max_len, kv_cache_bytes=256 << 20, max_num_seqs=64,
                               enforce_eager=eager, compile_cache_dir=str(cache), speculative=spec,
                               enable_prefix_caching=False))  # fmt: skip


def run(eng: Engine, prompts: list[list[int]], new: int, ignore_eos: bool = True) -> Run:
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=ignore_eos)
    before = eng.stats().speculative
    s0, d0, a0 = (before.steps, before.drafted, before.accepted) if before else (0, 0, 0)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", None, p, params)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    first: float | None = None
    steps = 0
    while eng.has_work:
        got = eng.step()
        if first is not None:
            steps += 1
        for o in got:
            outs[o.request_id].extend(o.token_ids)
        if first is None and any(outs.values()):
            first = time.perf_counter()
    end = time.perf_counter()
    after = eng.stats().speculative
    s, d, a = (after.steps - s0, after.drafted - d0, after.accepted - a0) if after else (0, 0, 0)
    tokens = sum(len(v) for v in outs.values())
    assert first is not None
    decode_ms = (end - first) * 1e3
    return Run(
        ms_per_token=decode_ms / max(tokens - len(prompts), 1),
        ms_per_step=decode_ms / max(steps, 1),
        accepted_length=1 + a / s if s else 1.0,
        acceptance=a / d if d else 0.0,
        tokens=[outs[f"r{i}"] for i in range(len(prompts))],
        wall_s=end - start,
        steps=steps,
        verify_steps=s,
        accepted=a,
        drafted=d,
    )


def merge(runs: list[Run]) -> Run:
    """Several one-sequence runs (one question after another) as one: totals over all of them."""
    tokens = sum(len(r.tokens[0]) - 1 for r in runs)
    decode_ms = sum(r.ms_per_token * max(len(r.tokens[0]) - 1, 1) for r in runs)
    steps = sum(r.steps for r in runs)
    verify = sum(r.verify_steps for r in runs)
    accepted = sum(r.accepted for r in runs)
    drafted = sum(r.drafted for r in runs)
    return Run(ms_per_token=decode_ms / max(tokens, 1), ms_per_step=decode_ms / max(steps, 1),
               accepted_length=1 + accepted / verify if verify else 1.0, acceptance=accepted / drafted if drafted
               else 0.0, tokens=[t for r in runs for t in r.tokens], wall_s=sum(r.wall_s for r in runs),
               steps=steps, verify_steps=verify, accepted=accepted, drafted=drafted)  # fmt: skip


@contextmanager
def serving(model: Path, spec: str, eager: bool, cache: Path, max_len: int, log: Path) -> Iterator[str]:
    """`glm5 serve` (one worker, --speculative-config SPEC) on free ports: its HTTP address once the router has
    the worker in rotation and, unless eager, the worker's steps run compiled (its log says so)."""
    http_port = free_port()
    worker = [f"--speculative-config={spec}", f"--max-model-len={max_len}", "--kv-cache-bytes=256MiB",
              "--no-prefix-caching", f"--compile-cache-dir={cache}"]  # fmt: skip
    if eager:
        worker.append("--enforce-eager")
    cmd = [sys.executable, "-m", "glm5_cli", "serve", "--model", str(model), "--http-port", str(http_port),
           "--grpc-port", str(free_port()), *(f"--worker-arg={w}" for w in worker)]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 900
        while not (_in_rotation(base) and (eager or any(m in log.read_text(errors="replace") for m in COMPILED))):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"glm5 serve ({spec}) did not come up; the end of its log ({log}):\n{tail(log)}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(60)


def _in_rotation(base: str) -> bool:
    try:
        conn = http.client.HTTPConnection(*base.split(":"), timeout=2)  # type: ignore[misc]
        conn.request("GET", "/health")
        health = json.loads(conn.getresponse().read())
        conn.close()
    except (OSError, ValueError):
        return False
    return bool(health.get("status") == "ok" and health.get("workers"))


def streamed(base: str, model: Path, ids: list[int], new: int) -> tuple[float, int, str]:
    """One streamed greedy completion to its end: (seconds from the first chunk to the last, completion tokens,
    the text)."""
    body = json.dumps({"model": model.name, "prompt": ids, "max_tokens": new, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})  # fmt: skip
    conn = http.client.HTTPConnection(*base.split(":"), timeout=300)  # type: ignore[misc]
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{base}: HTTP {resp.status}: {resp.read()[:300]!r}")
    arrivals, text, tokens = [], "", 0
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            arrivals.append(time.perf_counter())
            text += chunk["choices"][0]["text"]
    conn.close()
    return arrivals[-1] - arrivals[0], tokens, text


def served(a: argparse.Namespace, model: Path, method: str, ks: list[int], asked: list[list[int]], cache: Path,
           max_len: int) -> None:  # fmt: skip
    """The batch-1 questions through `glm5 serve`: without speculation and with `method` at each k."""
    specs = {("off", 0): "none", **{(method, k): json.dumps({"method": method, "num_speculative_tokens": k})
                                    for k in ks}}  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="glm5-spec-serve-"))
    with ExitStack() as stack:
        bases = {key: stack.enter_context(serving(model, spec, a.enforce_eager, cache, max_len,
                                                  logs / f"{key[0]}{key[1]}.log"))
                 for key, spec in specs.items()}  # fmt: skip
        for base in bases.values():  # warm-up: connections, the first allocations
            streamed(base, model, asked[0][:64], 4)
        per_token: dict[tuple[str, int], list[float]] = {key: [] for key in bases}
        texts: dict[tuple[str, int], list[str]] = {key: [] for key in bases}
        for _ in range(a.runs):
            for key, base in bases.items():
                answers = [streamed(base, model, q, a.new) for q in asked]
                seconds, tokens = sum(x[0] for x in answers), sum(x[1] - 1 for x in answers)
                per_token[key].append(seconds * 1e3 / max(tokens, 1))
                texts[key].append("\x00".join(x[2] for x in answers))
    base_ms = statistics.median(per_token[("off", 0)])
    want = texts[("off", 0)][0]
    print(f"\nthrough glm5 serve: the same {len(asked)} questions, streamed /v1/completions, ms per token after "
          f"the first chunk as the client reads them, medians of {a.runs} runs\n")  # fmt: skip
    print("| server | k | ms/token | vs off | text as off |")
    print("|---|---|---|---|---|")
    for (m, k), ms in per_token.items():
        med = statistics.median(ms)
        same = all(t == want for t in texts[(m, k)])
        print(f"| {m} | {k} | {med:.2f} | {base_ms / med:.2f}x | {'yes' if same else 'NO'} |")


def has_mtp(model: Path) -> bool:
    config = json.loads((model / "config.json").read_text())
    return int(config.get("num_nextn_predict_layers") or 0) > 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the shipped demo model)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64, help="tokens per sequence of the throughput runs")
    ap.add_argument("--questions", type=int, default=6, help="questions answered in turn per batch-1 run")
    ap.add_argument("--k", default="1,2,3", help="draft tokens to measure")
    ap.add_argument("--runs", type=int, default=3, help="batch-1 runs per row (medians)")
    ap.add_argument("--batches", default="1,2,4,8,32")
    ap.add_argument("--disable-by-batch-size", type=int, default=CPU_DISABLE_BY_BATCH_SIZE,
                    help="the guarded column's threshold (default: a CPU worker's)")  # fmt: skip
    ap.add_argument("--enforce-eager", action="store_true", help="eager steps (default: compiled, as glm5 worker)")
    ap.add_argument("--serve", action="store_true", help="also the batch-1 questions through glm5 serve")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.context, a.new, a.k, a.runs, a.batches, a.enforce_eager, a.questions = 128, 16, "1,3", 1, "1,4", True, 2
        a.serve = True
    model = a.model or default_model_path()
    ks = [int(x) for x in a.k.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    methods = ["ngram"] + (["mtp"] if has_mtp(model) else [])
    tok = Tokenizer(model)
    max_len = a.context + a.new + 64
    prompt = context(tok, a.context)
    asked = questions(tok, a.questions)
    cache = Path(tempfile.mkdtemp(prefix="glm5-spec-bench-"))
    mode = "eager" if a.enforce_eager else "compiled"
    lengths = sorted(len(q) for q in asked)
    print(f"model {model}, {mode} steps, batch 1: {len(asked)} held-out tool problems in turn (prompts of "
          f"{lengths[0]}-{lengths[-1]} tokens), medians of {a.runs} runs; methods: {', '.join(methods)}"
          f"{'' if 'mtp' in methods else ' (the checkpoint has no MTP layer)'}\n")  # fmt: skip

    engines: dict[tuple[str, int], Engine] = {("off", 0): engine(model, None, a.enforce_eager, cache, max_len)}
    for m in methods:
        for k in ks:
            engines[(m, k)] = engine(model, SpeculativeConfig(m, k), a.enforce_eager, cache, max_len)
    for eng in engines.values():  # warm-up: allocator, thread pools
        run(eng, [prompt[:64]], 4)
    results: dict[tuple[str, int], list[Run]] = {key: [] for key in engines}
    for _ in range(a.runs):  # interleaved: the machine's noise falls on every row alike
        for key, eng in engines.items():
            results[key].append(merge([run(eng, [q], a.new, ignore_eos=False) for q in asked]))
    base = statistics.median(r.ms_per_token for r in results[("off", 0)])
    want = results[("off", 0)][0].tokens
    print("| method | k | ms/token | vs off | ms/step | accepted length | acceptance | tokens as off |")
    print("|---|---|---|---|---|---|---|---|")
    for (m, k), rs in results.items():
        ms = statistics.median(r.ms_per_token for r in rs)
        step = statistics.median(r.ms_per_step for r in rs)
        equal = all(r.tokens == want for r in rs)
        print(f"| {m} | {k} | {ms:.2f} | {base / ms:.2f}x | {step:.2f} | {rs[0].accepted_length:.2f} | "
              f"{rs[0].acceptance:.2f} | {'yes' if equal else 'NO'} |")  # fmt: skip

    if a.serve:
        served(a, model, methods[-1], [1] if a.smoke else ks, asked, cache, max_len)

    k = max(ks)
    guarded = SpeculativeConfig(methods[-1], k, disable_by_batch_size=a.disable_by_batch_size)
    engines[("guarded", k)] = engine(model, guarded, a.enforce_eager, cache, max_len)
    run(engines[("guarded", k)], [prompt[:64]], 4)
    columns = [("off", 0), (methods[-1], k), ("guarded", k)]
    print(f"\nthroughput, generated tokens/s over the batch's wall time ({methods[-1]}, k = {k}; "
          f"guarded: disable_by_batch_size {a.disable_by_batch_size})\n")  # fmt: skip
    print(f"| batch | off tok/s | {methods[-1]} k={k} tok/s | guarded tok/s | speculative vs off | guarded vs off "
          "| sequences as off |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for batch in batches:
        prompts = [context(tok, a.context, index=i) for i in range(batch)]
        runs: dict[tuple[str, int], list[Run]] = {key: [] for key in columns}
        for _ in range(a.runs):
            for key in columns:
                runs[key].append(run(engines[key], prompts, a.new))
        rates = [batch * a.new / statistics.median(r.wall_s for r in runs[key]) for key in columns]
        want = runs[("off", 0)][0].tokens
        same = sum(x == y for x, y in zip(runs[columns[1]][0].tokens, want, strict=True))
        print(f"| {batch} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[2]:.1f} | {rates[1] / rates[0]:.2f}x | "
              f"{rates[2] / rates[0]:.2f}x | {same}/{batch} |")  # fmt: skip


if __name__ == "__main__":
    main()
