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


def smoke() -> None:
    """The usage lines' three plans; each must print a row per format."""
    glm5 = json.loads(CONFIG.read_text())
    assert plan(glm5, DEVICES["910b-64g"], 8, 1, 131072, "bfloat16", "bfloat16", 0.0) == 3
    assert plan(glm5, DEVICES["h200"], 8, 32, 131072, "bfloat16", "bfloat16", 0.0) == 3
    cpu = replace(DEVICES["cpu"], collective_us=450)
    assert plan(json.loads(DEMO_CONFIG.read_text()), cpu, 2, 1, 4096, "float32", "float32", 3.1) == 3
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
    a = ap.parse_args()
    if a.smoke:
        smoke()
        return
    c = json.loads(a.config.read_text())
    dev = DEVICES[a.device]
    for field in ("memory_gib", "hbm_gbps", "link_gbps", "collective_us"):
        if getattr(a, field) is not None:
            dev = replace(dev, **{field: getattr(a, field)})
    for n in a.tp:
        for b in a.batch:
            plan(c, dev, n, b, a.context, a.weights, a.kv_dtype, a.step_overhead_ms)


if __name__ == "__main__":
    main()
