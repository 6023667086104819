"""Decode speed of one replica on N = 1 and N = 2 ranks (tensor + expert parallel over gloo), same machine, same
run, one thread per rank (N = 1: one thread too), and where a step's time goes.

Each configuration serves `batch` requests of `prompt-len` random tokens, greedy, `new` tokens each; only steps
in which every running request decodes are timed. Per decode step it reports, on rank 0: wall time, the time in
the model's collectives (2 all-reduces per layer, the embedding's all-reduce, the logits' gather: this includes
waiting for the slower rank), the time sending the step to the other rank, and the rest (compute); and the
payload bytes handed to collectives per step, next to the formula
    L x 2 x B x hidden x b   (two all-reduces per layer)  +  B x hidden x b  (embedding)  +  B x V/N x 4  (logits)
with B the batch, b the activation dtype's bytes, V the vocabulary.

It first times the all-reduce alone (2 processes, one thread each, nothing else running): what
benchmarks/scaling_plan.py takes as --collective-us to predict the N = 2 run.

Usage: python benchmarks/tensor_parallel.py [--model DIR] [--batches 1,32] [--prompt-len 256] [--new 64]
                                            [--sizes 1,2] [--repeats 3] [--enforce-eager]
       python benchmarks/tensor_parallel.py --smoke     # batch 1, N = 1 and 2, 32-token prompts, 4 new, eager

N = 1 compiles its decode steps at start-up as `glm5 worker` does (a replica over several ranks runs eagerly);
--enforce-eager compares the two eagerly.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from glm5.allocator import retain_freed_memory
from glm5.model.presets import init_model
from glm5.parallel import TensorParallel
from glm5_worker.config import EngineConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams


def _formula(batch: int, layers: int, hidden: int, vocab: int, size: int, b: int) -> int:
    if size == 1:
        return 0
    return layers * 2 * batch * hidden * b + batch * hidden * b + batch * vocab // size * 4


def _allreduce_us(rank: int, world: int, numel: int, by_gather: bool, out: mp.Queue[float], rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['GLM5_BENCH_PORT']}", rank=rank,
                            world_size=world)  # fmt: skip
    tp = TensorParallel(rank, world, reduce_by_gather=by_gather)
    x = torch.ones(numel)
    for _ in range(rounds // 10):
        tp.all_reduce(x)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        tp.all_reduce(x)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times) * 1e6)
    dist.destroy_process_group()


def allreduce_latency(numel: int, by_gather: bool, world: int = 2, rounds: int = 1000) -> float:
    """Median microseconds of one all-reduce of `numel` float32 between `world` local processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["GLM5_BENCH_PORT"] = str(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    out: mp.Queue[float] = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_us, args=(r, world, numel, by_gather, out, rounds)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join()
    return float(result)


def decode_only(engine: Engine) -> bool:
    s = engine.scheduler
    return not s.waiting and bool(s.running) and all(seq.num_uncomputed == 1 for seq in s.running)


def run(model: Path, size: int, prompts: list[list[int]], new: int, eager: bool = False) -> dict[str, float]:
    engine = Engine(
        EngineConfig(
            model=str(model), max_model_len=2048, kv_cache_bytes=256 << 20, max_num_seqs=64, kv_int8_tier=False,
            tensor_parallel_size=size, collective_timeout_s=60, enforce_eager=eager,
        )
    )  # fmt: skip
    try:
        warm = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
        engine.add_request("warm", None, prompts[0][:32], warm)
        while engine.has_work:
            engine.step()
        params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", None, p, params)
        tp, control = engine.tp, engine.replica.control if engine.replica else None
        steps, tokens, wall = 0, 0, 0.0
        comm = ctrl = 0.0
        comm_bytes = 0
        while engine.has_work:
            timed = decode_only(engine)
            c0, b0, s0 = tp.comm.seconds, tp.comm.bytes, control.seconds if control else 0.0
            start = time.perf_counter()
            outs = engine.step()
            if timed:
                wall += time.perf_counter() - start
                steps += 1
                tokens += sum(len(o.token_ids) for o in outs)
                comm += tp.comm.seconds - c0
                comm_bytes += tp.comm.bytes - b0
                ctrl += (control.seconds if control else 0.0) - s0
        mc = engine.model_config
        return {
            "tok_s": tokens / wall,
            "step_ms": wall / steps * 1e3,
            "comm_ms": comm / steps * 1e3,
            "control_ms": ctrl / steps * 1e3,
            "bytes_step": comm_bytes / steps,
            "formula_step": _formula(
                len(prompts),
                mc.num_hidden_layers,
                mc.hidden_size,
                mc.vocab_size,
                size,
                torch.tensor([], dtype=engine.dtype).element_size(),
            ),
        }
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="checkpoint (default: a fresh tiny preset, seed 0)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true", help="N = 1 without compiled decode steps")
    ap.add_argument("--smoke", action="store_true", help="batch 1, N = 1 and 2, 32-token prompts, 4 new, eager")
    a = ap.parse_args()
    if a.smoke:
        a.batches, a.sizes, a.prompt_len, a.new, a.repeats, a.enforce_eager = "1", "1,2", 32, 4, 1, True
    os.environ["OMP_NUM_THREADS"] = "1"  # followers: one thread each
    torch.set_num_threads(1)  # rank 0 (and N = 1): one thread
    retain_freed_memory()
    model = Path(a.model) if a.model else init_model(Path(tempfile.mkdtemp()) / "tiny", preset="tiny", seed=0)
    sizes = [int(x) for x in a.sizes.split(",")]
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    print("all-reduce alone, 2 processes, 1 thread each (median us):")
    for b in (int(x) for x in a.batches.split(",")):
        rounds = 100 if a.smoke else 1000
        gather, ring = (
            allreduce_latency(b * hidden, True, rounds=rounds),
            allreduce_latency(b * hidden, False, rounds=rounds),
        )
        print(f"  {b} x {hidden} float32: all-gather + sum {gather:,.0f} us, gloo all_reduce {ring:,.0f} us")
    print(f"decode, {model.name}, prompts {a.prompt_len} tokens, {a.new} new, greedy, float32, 1 thread per rank, "
          f"gloo; medians of {a.repeats} runs alternating the sizes")  # fmt: skip
    print(f"{'batch':>5} {'N':>2} {'tok/s':>8} {'vs N=1':>7} {'step ms':>8} {'collectives ms':>15} "
          f"{'send step ms':>13} {'compute ms':>11} {'bytes/step':>11} {'formula':>8}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    table = 0
    for b in (int(x) for x in a.batches.split(",")):
        prompts = torch.randint(20, 1000, (b, a.prompt_len), generator=g).tolist()
        results: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
        for _ in range(a.repeats):
            for n in sizes:
                results[n].append(run(model, n, prompts, a.new, a.enforce_eager))
        base = statistics.median(r["tok_s"] for r in results[sizes[0]])
        for n in sizes:
            med = {k: statistics.median(r[k] for r in results[n]) for k in results[n][0]}
            compute = med["step_ms"] - med["comm_ms"] - med["control_ms"]
            print(
                f"{b:>5} {n:>2} {med['tok_s']:>8.1f} {med['tok_s'] / base:>6.2f}x {med['step_ms']:>8.2f} "
                f"{med['comm_ms']:>15.2f} {med['control_ms']:>13.2f} {compute:>11.2f} "
                f"{med['bytes_step']:>11,.0f} {med['formula_step']:>8,.0f}",
                flush=True,
            )
            table += 1
    if a.smoke:  # the table, not the speed: a row per batch and size, collectives counted at N = 2
        assert table == len(sizes) and all(r["bytes_step"] > 0 for r in results[2]), results
        print("smoke: ok")


if __name__ == "__main__":
    main()
