"""A deployment plan for one model replica over N devices, from a checkpoint's config.json and a device description.

For each weight format (bf16, block-FP8, INT4 routed experts + FP8 elsewhere) it computes, per rank under this
worker's tensor + expert parallelism (glm5.parallel):
- weight bytes per rank, and what is left of the device's memory for the KV cache;
- KV bytes per token per rank (every rank caches the whole latent of every token) and at the given context;
- collective bytes per decode step (payload, and what a ring moves per rank);
- decode tokens/s upper bounds: from memory bandwidth (the bytes a decode step must read on each rank: its
  weights that the step touches, the picked KV rows, the indexer keys of the whole context), from the links
  (2 all-reduces per layer: latency plus wire bytes), and both together (no overlap assumed).

Usage:
  python benchmarks/scaling_plan.py --device 910b-64g --tp 8              # GLM-5 (benchmarks/configs/glm5-744b.json)
  python benchmarks/scaling_plan.py --device h200 --tp 8 --batch 32
  python benchmarks/scaling_plan.py --config CKPT/config.json --device cpu --tp 2 --step-overhead-ms 3.1 \
      --collective-us 450 --kv-dtype float32 --weights float32     # predict a measured CPU run
  python benchmarks/scaling_plan.py --smoke     # the three above (the third on the shipped demo model's config)
  python benchmarks/scaling_plan.py --train      # the RL trainer: bytes per device at 64/128/256 devices, sync time

--train: the trainer's memory per device for the policy sharded over N devices (FSDP2, glm5_trainer.distributed)
with AdamW, at a stated micro-batch, and the time one weight version takes to reach an engine replica by the
collective transport at the network's bandwidth against the stream transport's measured rate.

Device numbers are public spec-sheet figures (see DEVICES); override any of them with --memory-gib, --hbm-gbps,
--link-gbps, --collective-us. Upper bounds, not predictions of a particular kernel's speed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parent / "configs" / "glm5-744b.json"
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "common" / "glm5" / "assets" / "glm5-tiny-addition" / "config.json"


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    hbm_gbps: float  # memory bandwidth, GB/s
    link_gbps: float  # per-direction bandwidth a ring hop gets between two devices, GB/s
    collective_us: float  # latency of one small all-reduce over the replica, microseconds


DEVICES = {
    # Ascend 910B (Atlas 800T A2): 64 GB HBM2e at ~1.6 TB/s; HCCS full mesh of 56 GB/s links inside a server (a
    # ring hop uses one); a small HCCL all-reduce over 8 NPUs costs tens of microseconds
    "910b-64g": Device("Ascend 910B 64 GB", 64, 1600, 56, 40),
    # NVIDIA H200 SXM: 141 GB HBM3e at 4.8 TB/s; NVLink 4 at 450 GB/s per direction; NCCL small all-reduce ~15 us
    "h200": Device("NVIDIA H200 141 GB", 141, 4800, 450, 15),
    # this project's CI machine: 24 GiB shared by the ranks, ~10 GB/s copy bandwidth, gloo over loopback
    "cpu": Device("CPU (2 cores, gloo on loopback)", 24, 10, 2, 450),
}
BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}


@dataclass
class Parts:
    """Parameter counts of the model, split by how they shard and which format they take."""

    attn_split: float = 0  # q_b, kv_b, o: split by heads
    attn_replicated: float = 0  # q_a, kv_a (+ norms)
    indexer_linear: float = 0  # wq_b, wk: quantised in FP8 checkpoints
    indexer_other: float = 0  # weights_proj, k_norm: bf16
    dense_mlp: float = 0  # split by intermediate
    shared_experts: float = 0  # split by intermediate
    routed_experts: float = 0  # partitioned (EP)
    router: float = 0  # replicated, bf16
    vocab: float = 0  # embed + lm_head: split by vocabulary, bf16
    norms: float = 0

    @property
    def total(self) -> float:
        return float(sum(vars(self).values()))


def parts(c: dict[str, Any]) -> Parts:
    h, L = c["hidden_size"], c["num_hidden_layers"]
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    qr, kvr = c["q_lora_rank"], c["kv_lora_rank"]
    hi, di = c["index_n_heads"], c["index_head_dim"]
    dense = min(c.get("first_k_dense_replace", 0), L)
    moe = L - dense
    p = Parts()
    p.attn_replicated = L * (h * qr + h * (kvr + rope))
    p.attn_split = L * (qr * heads * (nope + rope) + kvr * heads * (nope + v) + heads * v * h)
    p.indexer_linear = L * (qr * hi * di + h * di)
    p.indexer_other = L * (h * hi + 2 * di)
    p.norms = L * (2 * h + qr + kvr) + h
    p.dense_mlp = dense * 3 * h * c["intermediate_size"]
    p.shared_experts = moe * 3 * h * c["moe_intermediate_size"] * c.get("n_shared_experts", 1)
    p.routed_experts = moe * c["n_routed_experts"] * 3 * h * c["moe_intermediate_size"]
    p.router = moe * c["n_routed_experts"] * h
    p.vocab = (1 if c.get("tie_word_embeddings") else 2) * c["vocab_size"] * h
    return p


def formats(weights: str) -> dict[str, dict[str, float]]:
    """Bytes per parameter of each part under each checkpoint format (scales included: FP8 carries one float32
    per 128x128 block, INT4 one bfloat16 per group of 128)."""
    w = BYTES.get(weights, 2.0)
    fp8 = 1 + 4 / (128 * 128)
    int4 = 0.5 + 2 / 128
    plain = dict.fromkeys(vars(Parts()), w)
    fp8_parts = {**plain, "attn_split": fp8, "attn_replicated": fp8, "indexer_linear": fp8, "dense_mlp": fp8,
                 "shared_experts": fp8, "routed_experts": fp8}  # fmt: skip
    return {weights: plain, "fp8-block": fp8_parts, "int4-experts": {**fp8_parts, "routed_experts": int4}}


def per_rank_weights(p: Parts, fmt: dict[str, float], n: int) -> float:
    split = ("attn_split", "dense_mlp", "shared_experts", "routed_experts", "vocab")
    return float(sum(getattr(p, k) * fmt[k] / (n if k in split else 1) for k in vars(p)))


def decode_read_bytes(
    c: dict[str, Any], p: Parts, fmt: dict[str, float], n: int, batch: int, context: int, kv_b: float
) -> float:
    """Bytes one decode step reads on a rank: every weight it holds except routed experts no token of the batch
    picked (expected distinct experts among the rank's E/N), the top-k rows each token attends to, and the
    indexer keys of each sequence's whole context (the indexer scores all of them)."""
    e, k = c["n_routed_experts"], c["num_experts_per_tok"]
    moe_layers = c["num_hidden_layers"] - min(c.get("first_k_dense_replace", 0), c["num_hidden_layers"])
    per_expert = p.routed_experts / max(1, moe_layers * e)
    local = e / n
    hit = 1 - (1 - k / e) ** batch  # chance a given expert is picked by at least one of the batch's tokens
    experts = moe_layers * local * hit * per_expert * fmt["routed_experts"]
    others = per_rank_weights(replace(p, routed_experts=0), fmt, n)
    L, topk = c["num_hidden_layers"], min(c["index_topk"], context)
    kv_rows = batch * L * topk * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * kv_b
    index_keys = batch * L * context * c["index_head_dim"] * kv_b
    return float(others + experts + kv_rows + index_keys)


def plan(c: dict[str, Any], dev: Device, n: int, batch: int, context: int, weights: str, kv: str,
         overhead_ms: float) -> int:  # fmt: skip
    """Prints the plan; the number of formats in its table."""
    p = parts(c)
    kv_b = BYTES[kv]
    L, h = c["num_hidden_layers"], c["hidden_size"]
    full_layers = L  # GLM-5 runs an indexer on every layer
    kv_token = L * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * kv_b + full_layers * c["index_head_dim"] * kv_b
    act_b = 2.0 if weights != "float32" else 4.0
    payload = 2 * L * batch * h * act_b + batch * h * act_b + batch * c["vocab_size"] / n * 4  # per step, rank 0
    wire = 2 * (n - 1) / n * 2 * L * batch * h * act_b  # what a ring all-reduce sends per rank
    collectives = 2 * L + 2
    t_link = (collectives * dev.collective_us * 1e-6 + wire / (dev.link_gbps * 1e9)) if n > 1 else 0.0
    print(f"\n{dev.name} x {n}, batch {batch}, context {context:,} tokens, KV cache {kv}")
    size = f"{p.total / 1e9:,.1f}B" if p.total >= 1e9 else f"{p.total / 1e6:,.2f}M"
    print(f"  model: {size} parameters (MTP layers not counted: not used for serving)")
    print(f"  KV per token per rank: {kv_token:,.0f} B; at {context:,} tokens: {kv_token * context / 2**30:.2f} GiB "
          f"per sequence (every rank holds all of it)")  # fmt: skip
    print(f"  collectives per decode step: {collectives} ({2 * L} all-reduces of batch x hidden, the embedding's, "
          f"the logits' gather); payload {payload / 2**20:.2f} MiB, ring wire bytes per rank {wire / 2**20:.2f} MiB; "
          f"link time >= {t_link * 1e3:.2f} ms")  # fmt: skip
    print(f"  {'format':>13} {'weights/rank':>13} {'free/rank':>10} {'seqs@ctx':>9} {'read/step':>10} "
          f"{'HBM tok/s':>10} {'link tok/s':>11} {'both tok/s':>11}")  # fmt: skip
    rows = 0
    for name, fmt in formats(weights).items():
        w = per_rank_weights(p, fmt, n)
        free = dev.memory_gib * 2**30 * 0.9 - w
        seqs = free / (kv_token * context) if free > 0 else 0.0
        read = decode_read_bytes(c, p, fmt, n, batch, context, kv_b)
        t_mem = read / (dev.hbm_gbps * 1e9)
        t = t_mem + t_link + overhead_ms / 1e3
        fits = "" if free > 0 else "  (does not fit)"
        link = batch / t_link if t_link else float("inf")
        print(
            f"  {name:>13} {w / 2**30:>10.1f} GiB {free / 2**30:>6.1f} GiB {seqs:>9.1f} {read / 2**30:>6.2f} GiB "
            f"{batch / t_mem:>10,.0f} {link:>11,.0f} {batch / t:>11,.0f}{fits}"
        )
        rows += 1
    return rows


# The network a device's trainer rank sends its weight-sync bytes over (GB/s per device, one direction): 910B
# servers have a 200 Gb/s RoCE port per NPU, H200 servers a 400 Gb/s InfiniBand port per GPU.
SYNC_GBPS = {"910b-64g": 25.0, "h200": 50.0, "cpu": 0.75}
# benchmarks/rl_scale.py on this machine (docs/benchmarks.md): the stream transport's rate (gRPC, staged to disk)
STREAM_GBPS = 0.15


@dataclass(frozen=True)
class TrainBytes:
    sharded: float  # parameters + gradients + AdamW moments, this device's 1/N
    working: float  # the unsharded layers FSDP2 all-gathers around the one computing (and its gradients)
    activations: float

    @property
    def total(self) -> float:
        return self.sharded + self.working + self.activations


def layer_params(c: dict[str, Any], p: Parts) -> tuple[float, float]:
    """(the largest decoder layer's parameters, of which routed experts): FSDP2's unit is one layer."""
    L = c["num_hidden_layers"]
    moe = L - min(c.get("first_k_dense_replace", 0), L)
    per_layer_common = (p.attn_split + p.attn_replicated + p.indexer_linear + p.indexer_other + p.norms) / L
    routed = p.routed_experts / max(1, moe)
    shared = p.shared_experts / max(1, moe) + p.router / max(1, moe)
    return per_layer_common + routed + shared, routed


def train_bytes(c: dict[str, Any], p: Parts, n: int, tokens: int, state_bytes: float, expert_parallel: bool,
                checkpointing: bool = True) -> TrainBytes:  # fmt: skip
    """One device's bytes for training with the policy sharded over n devices.

    - sharded: every parameter's `state_bytes` (ours: a float32 parameter, float32 gradient and two float32
      AdamW moments = 16; bf16 parameters and gradients with float32 moments = 12) over n;
    - working: FSDP2 all-gathers a layer's parameters in bf16 before computing it and prefetches the next (2
      layers x 2 bytes), and holds that layer's unsharded gradients in float32 for the reduce-scatter (4 bytes).
      With expert parallelism (experts partitioned over the devices, tokens sent to them by all-to-all, as
      slime/Megatron train GLM-5) the routed experts are never all-gathered: only the rest of the layer is;
    - activations (bf16, per micro-batch of `tokens`): with activation checkpointing every layer keeps its input
      (tokens x hidden) and one layer is recomputed at a time (its attention and MLP intermediates, the routed
      experts' for top-k of them); plus the logits in float32 (tokens x vocabulary, the loss's log-softmax).
    """
    layer, routed = layer_params(c, p)
    gathered = layer - routed if expert_parallel else layer
    working = gathered * (2 * 2 + 4)
    h, L = c["hidden_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    attn = heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) + heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
    attn += heads * c["v_head_dim"] + c["q_lora_rank"] + c["kv_lora_rank"] + c["index_n_heads"] * c["index_head_dim"]
    mlp = c["num_experts_per_tok"] * 3 * c["moe_intermediate_size"] + 3 * c["moe_intermediate_size"]
    one_layer = tokens * (attn + mlp + 4 * h) * 2
    kept = L * tokens * h * 2 if checkpointing else L * one_layer
    logits = tokens * c["vocab_size"] * 4
    return TrainBytes(p.total * state_bytes / n, working, kept + one_layer + logits)


def train_plan(c: dict[str, Any], devices: list[str], counts: list[int], tokens: int, stream_gbps: float,
               engine_ranks: int) -> list[tuple[str, int, str, bool]]:  # fmt: skip
    """Prints the trainer plan; (device, n, layout, fits) per row."""
    p = parts(c)
    layouts = [("FSDP2 per layer, experts gathered (--no-expert-parallel)", 16.0, False),
               ("FSDP2 + EP, fp32 master (ours, default)", 16.0, True),
               ("FSDP2 + EP, bf16 params, fp32 moments", 12.0, True)]  # fmt: skip
    print(f"\ntrainer memory per device: {p.total / 1e9:,.1f}B parameters, AdamW, micro-batch {tokens:,} tokens, "
          "activation checkpointing, 90% of device memory usable")  # fmt: skip
    print("\n| device | devices | layout | sharded state | working layers | activations | total | fits |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    rows = []
    for key in devices:
        dev = DEVICES[key]
        for n in counts:
            for name, state, ep in layouts:
                b = train_bytes(c, p, n, tokens, state, ep)
                fits = b.total <= dev.memory_gib * 2**30 * 0.9
                rows.append((key, n, name, fits))
                gib = " | ".join(f"{x / 2**30:,.1f} GiB" for x in (b.sharded, b.working, b.activations, b.total))
                print(f"| {dev.name} | {n} | {name} | {gib} | {'yes' if fits else 'no'} |")
    print()
    for key in devices:
        for name, *_ in layouts:
            fit = [n for d, n, lay, ok in rows if d == key and lay == name and ok]
            print(f"- {DEVICES[key].name}, {name}: smallest that fits "
                  f"{f'{min(fit)} devices' if fit else f'none up to {max(counts)}'}")  # fmt: skip
    version = p.total * 2  # what a version weighs in bf16
    # each engine rank asks only for what its shard reads: its 1/N of the split parts, the replicated ones whole
    per_rank = per_rank_weights(p, formats("bfloat16")["bfloat16"], engine_ranks)
    print(f"\nweight sync of one version ({version / 1e12:.2f} TB in bf16) into a replica of {engine_ranks} engine "
          f"ranks; each engine rank receives only what its shard reads ({per_rank / 1e9:.0f} GB, "
          f"{per_rank / version:.3f} of the version), the ranks in parallel, so a rank's network port bounds the "
          "collective; the stream transport at its measured rate sends the whole version:")  # fmt: skip
    print("\n| device | collective: GB/s per engine rank | collective | stream at "
          f"{stream_gbps:.2f} GB/s | stream / collective |\n|---|---:|---:|---:|---:|")  # fmt: skip
    for key in devices:
        gbps = SYNC_GBPS[key]
        coll = per_rank / (gbps * 1e9)
        stream = version / (stream_gbps * 1e9)
        print(f"| {DEVICES[key].name} | {gbps:.0f} | {coll:,.1f} s | {stream / 3600:,.1f} h | {stream / coll:,.0f}x |")
    return rows


def smoke() -> None:
    """The usage lines' three plans; each must print a row per format."""
    glm5 = json.loads(CONFIG.read_text())
    assert plan(glm5, DEVICES["910b-64g"], 8, 1, 131072, "bfloat16", "bfloat16", 0.0) == 3
    assert plan(glm5, DEVICES["h200"], 8, 32, 131072, "bfloat16", "bfloat16", 0.0) == 3
    cpu = replace(DEVICES["cpu"], collective_us=450)
    assert plan(json.loads(DEMO_CONFIG.read_text()), cpu, 2, 1, 4096, "float32", "float32", 3.1) == 3
    rows = train_plan(glm5, ["910b-64g", "h200"], [64, 128, 256], 8192, STREAM_GBPS, 8)
    assert len(rows) == 2 * 3 * 3
    print("smoke: ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIG, help="a checkpoint's config.json")
    ap.add_argument("--device", default="910b-64g", choices=sorted(DEVICES))
    ap.add_argument("--tp", type=int, nargs="+", default=[8], help="devices per replica")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--weights", default="bfloat16", choices=sorted(BYTES), help="the unquantised format")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=sorted(BYTES))
    ap.add_argument("--memory-gib", type=float)
    ap.add_argument("--hbm-gbps", type=float)
    ap.add_argument("--link-gbps", type=float)
    ap.add_argument("--collective-us", type=float)
    ap.add_argument("--step-overhead-ms", type=float, default=0.0, help="fixed per-step time (host overhead)")
    ap.add_argument("--smoke", action="store_true", help="the usage lines' three plans, each table checked")
    ap.add_argument("--train", action="store_true", help="the RL trainer's plan instead of serving's")
    ap.add_argument("--train-devices", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--train-tokens", type=int, default=8192, help="tokens per micro-batch on a device")
    ap.add_argument("--stream-gbps", type=float, default=STREAM_GBPS, help="the stream transport's measured rate")
    ap.add_argument("--engine-ranks", type=int, default=8, help="ranks of the engine replica a sync feeds")
    a = ap.parse_args()
    if a.smoke:
        smoke()
        return
    c = json.loads(a.config.read_text())
    if a.train:
        train_plan(c, ["910b-64g", "h200"], a.train_devices, a.train_tokens, a.stream_gbps, a.engine_ranks)
        return
    dev = DEVICES[a.device]
    for field in ("memory_gib", "hbm_gbps", "link_gbps", "collective_us"):
        if getattr(a, field) is not None:
            dev = replace(dev, **{field: getattr(a, field)})
    for n in a.tp:
        for b in a.batch:
            plan(c, dev, n, b, a.context, a.weights, a.kv_dtype, a.step_overhead_ms)


if __name__ == "__main__":
    main()
