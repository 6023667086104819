"""The trainer at RL scale: step time and per-rank memory at 1 / 2 / 4 ranks, and the seconds and GB/s one
weight version takes to reach an engine by each transport, on a model large enough for the bytes to matter
(random weights; results in docs/benchmarks.md; target: collective >= 3x faster than the disk path).

    python -m benchmarks.rl_scale [--experts 32] [--hidden 1024] [--worlds 1,2,4] [--layouts ep,fsdp] [--steps 3]
                                  [--rows 8] [--tokens 64] [--trainer-ranks 2] [--rounds 3] [--bucket-mib 256] [--smoke]

Steps: for each world size, that many trainer ranks (FSDP2 over gloo, started as torchrun starts them, one
thread each) train on one fixed batch of --rows rows of --tokens tokens; one warm-up step, then --steps timed.
At more than one rank, each of --layouts: the routed experts split over the ranks (expert parallel, the
tokens sent to them) or gathered onto every rank by FSDP2 per layer (--no-expert-parallel).
Per world: the median step seconds, the speed-up over one rank, and each rank's peak RSS and parameter +
gradient + AdamW bytes (which sharding divides by the world). The machine has 2 cores: 4 ranks share them.

Sync: one `glm5 worker` (eager, float32) serves the model; a trainer of --trainer-ranks ranks holds the same
model. After a warm-up sync by each transport (not counted), per round and transport one new version reaches
the worker and is swapped in:
- collective: glm5_trainer.sync (every trainer rank sends the worker its own rows of each bucket over a gloo
  group, the worker builds its shard from each bucket: no file, nothing gathered);
- path: the ranks publish actor_synced (safetensors, each rank its files) and the worker reads it (UpdateWeights);
- stream: the same published files sent over gRPC (PushWeights), staged, checked and read by the worker.
Medians over rounds; the ratios are path / collective and stream / collective. Peak memory: trainer rank 0's
ru_maxrss growth over its first sync (collective) against the model's bytes (it holds two segments of a bucket,
not the model), and the worker's peak RSS against its weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._launch import Tokens, start  # noqa: E402
from tests.helpers.procs import free_port  # noqa: E402

LAYOUTS = {"ep": "expert parallel", "fsdp": "gathered by FSDP2"}


def build_model(out: Path, hidden: int, experts: int, seed: int = 0) -> tuple[Path, int]:
    """A random checkpoint of the tiny preset's shape, widened (hidden, experts): (path, parameters)."""
    from glm5.model.loader import save_checkpoint
    from glm5.model.model import GlmMoeDsaForCausalLM
    from glm5.model.presets import init_model, init_weights, preset_config

    base = init_model(out, preset="tiny", seed=seed)
    raw = json.loads((base / "config.json").read_text())
    config = preset_config("tiny", raw["vocab_size"], raw.get("eos_token_id") or [], hidden_size=hidden,
                           intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2, n_routed_experts=experts,
                           q_lora_rank=hidden // 4, kv_lora_rank=hidden // 8)  # fmt: skip
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(config)
    init_weights(model, seed)
    save_checkpoint(model, out)
    return out, sum(p.numel() for p in model.parameters())


def step_main(a: argparse.Namespace) -> None:
    """One trainer rank of the step phase: every rank trains on the same fixed batch; each writes its numbers."""
    import random

    from glm5.v1 import tito_pb2
    from glm5_trainer.distributed import World, init, leave, state_bytes
    from glm5_trainer.policy import Policy

    torch.set_num_threads(1)
    world = World.from_env()
    if world.size > 1:
        init(world, torch.device("cpu"), timeout_s=600)
    policy = Policy(a.model, world=world, dtype=torch.float32, learning_rate=1e-5, expert_parallel=a.layout == "ep")
    rng = random.Random(0)
    records = []
    for i in range(a.rows):
        prompt = a.tokens // 4
        ids = [rng.randrange(policy.vocab_size) for _ in range(a.tokens)]
        records.append(tito_pb2.RolloutRecord(
            rollout_id=f"r{i}", group_id=f"g{i // 4}", token_ids=ids,
            loss_mask=[0] * prompt + [1] * (a.tokens - prompt), logprobs=[0.0] * a.tokens,
            token_versions=[0] * a.tokens, turn_versions=[0], reward=float(i % 2),
        ))  # fmt: skip
    for r, logp in zip(records, policy.recompute(records), strict=True):  # in the trust region: every token counts
        r.logprobs[a.tokens // 4 :] = logp
    times = []
    for step in range(1 + a.steps):
        start_t = time.perf_counter()
        policy.step(records)
        if step:
            times.append(time.perf_counter() - start_t)
    mine = {"times": times, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "bytes": state_bytes(policy.model, policy.optimizer)}  # fmt: skip
    (a.out / f"step{world.rank}.json").write_text(json.dumps(mine))
    leave()


def rank_main(a: argparse.Namespace) -> None:
    """One trainer rank of the sync phase: rank 0 runs the rounds, the others follow its commands."""
    from glm5.security import Secret
    from glm5.tokenizer import Tokenizer
    from glm5_trainer.distributed import leave
    from glm5_trainer.sync import CollectiveSync, manifest, sync_engines
    from glm5_trainer.versions import sync_workers

    from tests.helpers.sync_trainer import open_ranks

    world, policy, versions, ranks = open_ranks(a.model, a.out, timeout_s=600)
    if not world.leader:
        ranks.follow()
        leave()
    admin, internal = Secret(os.environ["GLM5_BENCH_ADMIN_TOKEN"]), Secret(os.environ["GLM5_BENCH_INTERNAL_TOKEN"])
    sync = CollectiveSync("127.0.0.1", 0, timeout_s=600, bucket_bytes=a.bucket_mib << 20)
    nbytes = manifest(policy.model, 0, sync.bucket_bytes, world.size).nbytes
    fingerprint = Tokenizer(a.model).fingerprint
    times: dict[str, list[float]] = {"collective": [], "path": [], "path, from disk": [], "stream": []}
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        del times["path, from disk"]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss_growth = 0
    for round_ in range(1 + a.rounds):  # round 0 warms up (connections, first allocations): not counted
        for transport in times:
            versions.latest += 1
            start_t = time.perf_counter()
            if transport == "collective":
                (result,) = asyncio.run(sync_engines(ranks, sync, {a.engine: a.worker_tp}, versions.latest, fingerprint,
                                                     admin_token=admin, internal_token=internal))  # fmt: skip
                if isinstance(result, BaseException):
                    raise result
                if not round_:  # ru_maxrss only grows: the first sync's peak, before any publish
                    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
            else:
                path = ranks.publish()
                if transport == "path, from disk":  # what a reader on another node gets: the bytes via the disk
                    _drop_caches()
                asyncio.run(sync_workers([a.engine], versions.latest, path, admin_token=admin,
                                         transport=transport.split(",")[0], internal_token=internal))  # fmt: skip
            if round_:
                times[transport].append(time.perf_counter() - start_t)
    ranks.stop()
    sync.close()
    result = {"bytes": nbytes, "times": times, "rank0_rss_growth": rss_growth}
    (a.out / "result.json").write_text(json.dumps(result))
    leave()


def _ranks(n: int, argv: list[str], env: dict[str, str]) -> list[int]:
    """Starts `n` ranks of `python -m benchmarks.rl_scale ARGV` as torchrun would; their exit codes."""
    port = free_port()
    procs = []
    try:
        for rank in range(n):
            rank_env = {**os.environ, **env, "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
            if n == 1:
                rank_env.pop("WORLD_SIZE")
            procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.rl_scale", *argv], cwd=ROOT, env=rank_env))
        return [p.wait(timeout=3600) for p in procs]
    finally:
        for p in procs:
            p.kill()


def steps(a: argparse.Namespace, model: Path, work: Path) -> None:
    if not a.worlds:
        return
    rows = []
    for n in a.worlds:
        for layout in a.layouts if n > 1 else ["ep"]:  # one rank: nothing to split
            out = work / f"steps{n}{layout}"
            out.mkdir()
            argv = ["--step-main", "--model", str(model), "--out", str(out), "--steps", str(a.steps), "--rows",
                    str(a.rows), "--tokens", str(a.tokens), "--layouts", layout]  # fmt: skip
            codes = _ranks(n, argv, {})
            if any(codes):
                raise SystemExit(f"step ranks at world {n} ({layout}) exited with {codes}")
            ranks = [json.loads((out / f"step{r}.json").read_text()) for r in range(n)]
            rows.append((n, "-" if n == 1 else LAYOUTS[layout], statistics.median(ranks[0]["times"]), ranks))
    base = rows[0][2]  # the same global batch at every world: the speed-up is the first world's time over this
    print(f"\ntraining steps: {a.rows} rows x {a.tokens} tokens, float32, medians of {a.steps} after a warm-up\n")
    print("| ranks | experts | step s | speed-up | peak RSS per rank (max) | state bytes per rank (max) | "
          "state vs 1 rank |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|")
    state1 = max(sum(r["bytes"].values()) for r in rows[0][3]) * rows[0][0]
    for n, layout, med, ranks in rows:
        rss = max(r["rss"] for r in ranks)
        state = max(sum(r["bytes"].values()) for r in ranks)
        print(f"| {n} | {layout} | {med:.2f} | {base / med:.2f}x | {rss / 2**30:.2f} GiB | {state / 2**30:.2f} GiB | "
              f"{state / state1:.3f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument(
        "--worlds",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[1, 2, 4],
        help="trainer world sizes of the step phase ('': none)",
    )
    ap.add_argument("--layouts", type=lambda v: [x for x in v.split(",") if x], default=list(LAYOUTS),
                    help="the experts' layouts the step phase compares at more than one rank: ep (split over the "
                    "ranks, tokens sent to them), fsdp (FSDP2 gathers a layer's experts onto every rank)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per world (after one warm-up)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per row")
    ap.add_argument("--trainer-ranks", type=int, default=2, help="the trainer's ranks in the sync phase")
    ap.add_argument("--worker-tp", type=int, default=1, help="the worker's tensor-parallel ranks in the sync phase "
                    "(each receives only the parts of each tensor its shard reads)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="a small model, one round: the whole path in seconds")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--step-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.layout = a.layouts[0] if a.layouts else "ep"
    if unknown := set(a.layouts) - set(LAYOUTS):
        ap.error(f"--layouts: unknown {sorted(unknown)} (have: {', '.join(LAYOUTS)})")
    if a.rank_main:
        rank_main(a)
        return
    if a.step_main:
        step_main(a)
        return
    if a.smoke:
        a.hidden, a.experts, a.rounds, a.bucket_mib = 128, 8, 1, 1
        a.worlds, a.steps, a.rows, a.tokens = [1, 2], 1, 2, 16
    work = Path(tempfile.mkdtemp(prefix="glm5-rl-scale-"))
    try:
        run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the model and its published versions: GBs


def run(a: argparse.Namespace, work: Path) -> None:
    model, params = build_model(work / "model", a.hidden, a.experts)
    print(f"model: {params / 1e6:.0f}M parameters ({params * 4 / 2**30:.2f} GiB in float32)", flush=True)
    steps(a, model, work)
    tokens = Tokens.fresh()
    out = work / "out"
    out.mkdir()
    flags = ["--enforce-eager", "--max-model-len", "256", "--kv-cache-bytes", "16MiB", *Tokens.worker_flags(out)]
    tp = ["-tp", str(a.worker_tp)] if a.worker_tp > 1 else []
    worker = start(["worker", "--model", str(model), *tp, *flags], tokens, work / "worker.log", 900)
    try:
        argv = ["--rank-main", "--model", str(model), "--out", str(out), "--engine", worker.target, "--rounds",
                str(a.rounds), "--bucket-mib", str(a.bucket_mib), "--worker-tp", str(a.worker_tp)]  # fmt: skip
        codes = _ranks(a.trainer_ranks, argv, tokens.env())
        if any(codes):
            raise SystemExit(f"trainer ranks exited with {codes}; the worker's log: {worker.log}")
        info = _worker_rss(worker.target, tokens)
    finally:
        worker.proc.terminate()
        worker.proc.wait(30)
    r = json.loads((out / "result.json").read_text())
    gb = r["bytes"] / 1e9
    med = {t: statistics.median(v) for t, v in r["times"].items()}
    print(f"\nweight sync: {gb:.2f} GB per version, trainer ranks {a.trainer_ranks}, worker ranks {a.worker_tp}, "
          f"bucket {a.bucket_mib} MiB; medians of {a.rounds} rounds after a warm-up\n")  # fmt: skip
    # what each worker rank took of the version, by its log (the last sync wins)
    logged = re.findall(r"rank (\d+) receives (\d+) of the version's (\d+) bytes", Path(worker.log).read_text())
    took = {int(r): (int(n), int(t)) for r, n, t in logged}
    for rank, (n, total) in sorted(took.items()):
        print(f"collective: worker rank {rank} receives {n / 1e9:.2f} of the version's {total / 1e9:.2f} GB "
              f"({n / total:.2f})")  # fmt: skip
    print(flush=True)
    print("| transport | seconds | GB/s | vs collective |\n|---|---:|---:|---:|")
    for t, sec in med.items():
        print(f"| {t} | {sec:.2f} | {gb / sec:.2f} | {sec / med['collective']:.2f}x |")
    if "path, from disk" not in med:
        print("\n(path, from disk: not measured, /proc/sys/vm/drop_caches is not writable here)")
    print(f"\ntrainer rank 0 peak RSS growth over its first sync (collective): {r['rank0_rss_growth'] / 2**20:.0f} MiB "
          f"({r['rank0_rss_growth'] / r['bytes']:.2f} of the model's bytes); worker peak RSS {info}")  # fmt: skip


def _drop_caches() -> bool:
    """Written files out to the disk and the page cache emptied, so the next read comes from the disk (root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _worker_rss(target: str, tokens: Tokens) -> str:
    import grpc
    from glm5.client import worker_stub
    from glm5.v1 import worker_pb2

    with grpc.insecure_channel(target) as ch:
        stats = worker_stub(ch, tokens.internal).GetStats(worker_pb2.GetStatsRequest(), timeout=30)
    return ", ".join(f"rank {m.rank}: {m.host_rss_bytes / 2**20:.0f} MiB (weights {m.weight_bytes / 2**20:.0f} MiB)"
                     for m in stats.ranks)  # fmt: skip


if __name__ == "__main__":
    main()
