"""Engine throughput against transformers' generate on the same tiny checkpoint, same greedy outputs.

1K-token prompts, 128 new tokens, greedy, batch 1 / 8 / 32. Tokens/s counts generated tokens over the
wall time of the whole batch (prefill included). Our engine runs with its defaults except the INT8 KV tier
(off here so outputs can be compared token for token; a second row shows the tier on).

Usage: python benchmarks/engine_throughput.py [--batches 1,8,32] [--prompt-len 1024] [--new 128]
                                              [--allocator retain|system] [--ours-only] [--enforce-eager]
       python benchmarks/engine_throughput.py --smoke     # batches 1 and 4, 64-token prompts, 8 new, eager, 1 thread

--ours-only times our engine alone (one line per batch: tokens/s): run it alternately from two checkouts
(PYTHONPATH=OTHER/common:OTHER/services/worker) to compare two versions of the engine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from glm5.allocator import retain_freed_memory
from glm5.model.presets import init_model
from glm5_worker.config import EngineConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams


def ours(
    model: Path, prompts: list[list[int]], new: int, int8_tier: bool, eager: bool = False
) -> tuple[float, list[list[int]]]:
    """Our engine as `glm5 worker` runs it (decode steps compiled at start-up unless `eager`)."""
    engine = Engine(
        EngineConfig(
            model=str(model), max_model_len=4096, kv_cache_bytes=1 << 30, kv_int8_tier=int8_tier, max_num_seqs=64,
            enforce_eager=eager,
        )
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    # warm-up request (allocator, thread pools), not timed
    engine.add_request("warm", None, prompts[0][:64], SamplingParams(temperature=0.0, max_new_tokens=4))
    while engine.has_work:
        engine.step()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, p, params)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for o in engine.step():
            outs[o.request_id].extend(o.token_ids)
    return time.perf_counter() - start, [outs[f"r{i}"] for i in range(len(prompts))]


def reference(model: Path, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]], int]:
    """transformers generate: time, tokens, and how many sequences its own full forward re-derives
    (teacher-forced argmax equal to what generate produced): near-ties flip even inside transformers."""
    from transformers import GlmMoeDsaForCausalLM

    hf: Any = GlmMoeDsaForCausalLM.from_pretrained(model, dtype=torch.float32)  # its stubs do not type generate
    hf.eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        hf.generate(ids[:1, :64], max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - start
        gen = out[:, ids.shape[1] :]
        consistent = 0
        for row in out:
            again = hf(row[None, :-1]).logits[0, ids.shape[1] - 1 :].argmax(-1)
            consistent += int(torch.equal(again, row[ids.shape[1] :]))
    return elapsed, gen.tolist(), consistent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", help="checkpoint (default: a fresh tiny preset, seed 0)")
    ap.add_argument(
        "--allocator",
        default="retain",
        choices=["retain", "system"],
        help="retain: keep freed host memory in the process, as the worker does (glm5.allocator)",
    )
    ap.add_argument("--ours-only", action="store_true", help="time our engine only (INT8 tier off)")
    ap.add_argument("--enforce-eager", action="store_true", help="our engine without compiled decode steps")
    ap.add_argument("--smoke", action="store_true", help="batches 1 and 4, 64-token prompts, 8 new, eager, 1 thread")
    a = ap.parse_args()
    if a.smoke:
        a.batches, a.prompt_len, a.new, a.enforce_eager, a.threads = "1,4", 64, 8, True, 1
    torch.set_num_threads(a.threads)
    if a.allocator == "retain":
        retain_freed_memory()
    model = Path(a.model) if a.model else init_model(Path(tempfile.mkdtemp()) / "tiny", preset="tiny", seed=0)
    print(
        f"engine vs transformers generate: tiny preset, prompts {a.prompt_len} tokens, {a.new} new, greedy, "
        f"float32, {a.threads} threads, {a.allocator} allocator"
    )
    print(
        f"{'batch':>5} {'transformers tok/s':>19} {'ours tok/s':>11} {'speed-up':>9} {'same tokens':>12} "
        f"{'hf self-consistent':>19} {'ours+INT8 tier tok/s':>21} {'INT8 same':>10}"
    )
    g = torch.Generator().manual_seed(0)
    rows = 0
    for b in (int(x) for x in a.batches.split(",")):
        prompts = torch.randint(20, 1000, (b, a.prompt_len), generator=g).tolist()
        if a.ours_only:
            t_ours, got = ours(model, prompts, a.new, int8_tier=False, eager=a.enforce_eager)
            print(f"{b:>5} {b * a.new / t_ours:>11.1f}", flush=True)
            rows += all(len(x) == a.new for x in got)
            continue
        t_ref, ref, consistent = reference(model, prompts, a.new)
        t_ours, got = ours(model, prompts, a.new, int8_tier=False, eager=a.enforce_eager)
        t_q, got_q = ours(model, prompts, a.new, int8_tier=True, eager=a.enforce_eager)
        total = b * a.new
        same = sum(x == y for x, y in zip(got, ref, strict=True))
        same_q = sum(x == y for x, y in zip(got_q, ref, strict=True))
        print(
            f"{b:>5} {total / t_ref:>19.1f} {total / t_ours:>11.1f} {t_ref / t_ours:>8.1f}x {same:>6}/{b:<5} "
            f"{consistent:>13}/{b:<5} {total / t_q:>21.1f} {same_q:>5}/{b:<4}",
            flush=True,
        )
        rows += all(len(x) == a.new for x in (*ref, *got, *got_q))
    if a.smoke:  # the table, not the speed: a row per batch, every sequence of every engine at full length
        assert rows == len(a.batches.split(",")), rows
        print("smoke: ok")


if __name__ == "__main__":
    main()
