"""Decode attention at long contexts: gathered sparse attention (DSA) vs dense absorbed MLA, same cache.

GLM-5's attention sizes (64 heads, kv_lora_rank 512, rope 64, indexer 32 heads x 128, top-k 2048), one
decode token, one layer, same process and dtype. Both sides start from the projected query (the
projections cost the same for both and are left out) and read the same paged latent cache:

  dense      absorbed attention over every cached token, read in place (the strongest dense baseline)
  gather     the engine's short-context path: gather all indexer keys, score in float32, torch.topk,
             gather the picked latents, attend
  sparse     the engine's long-context path: score indexer keys in place run by run in the cache dtype,
             threshold top-k, gather the picked latents, attend
  shared     a "shared" indexer layer: reuse the full layer's picks, gather, attend

`--index-dtype bfloat16` keeps the indexer keys in bfloat16 whatever `--dtype` is (the worker's
`--kv-index-dtype`); the latent cache and both attention paths keep `--dtype`. `--device cuda --kernels triton`
runs the sparse paths on the fused Triton kernels (the worker's `--kernels`); dense stays the portable one.
`--allocator retain` (the default, as in the worker: glm5.allocator) keeps freed host memory in the process;
`system` is glibc's default, under which each call maps its large buffers afresh (measured: the gather path).

Usage: python benchmarks/decode_attention.py [--dtype bfloat16] [--index-dtype bfloat16]
                                             [--contexts 4096,16384,65536,131072]
                                             [--device cpu|cuda] [--kernels auto|portable|triton]
                                             [--allocator retain|system]
       python benchmarks/decode_attention.py --smoke     # 4096 tokens, 3 rounds, 1 thread, each dtype

`--smoke` runs on the CPU (the default `--device`; `--device cuda --kernels triton --smoke` checks the GPU path
where there is one) with one thread: on a shared 2-core machine two OpenMP threads whose cores are busy wait for
each other at every barrier (40x slower here).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from glm5.allocator import retain_freed_memory
from glm5.kernels import PortableKernels, kernels_for
from glm5.kvcache.storage import KVLayout, PagedKVStorage
from glm5.model.attention import DSAControls, MLAttention, _Selector
from glm5.model.batch import DecodeGroup, ForwardBatch
from glm5.model.config import ModelConfig

GLM5: dict[str, Any] = dict(
    num_attention_heads=64,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=192,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    q_lora_rank=2048,
)
BLOCK = 64
CPU = torch.device("cpu")


def interleaved(
    fns: Mapping[str, Callable[[], object]], rounds: int, sync: Callable[[], None] = lambda: None
) -> dict[str, list[float]]:
    """Times each function once per round, in turn, so machine noise hits all of them alike."""
    for fn in fns.values():
        fn()
    sync()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            sync()
            out[name].append((time.perf_counter() - t) * 1e3)
    return out


def bench(
    context: int,
    dtype: torch.dtype,
    repeats: int,
    index_dtype: torch.dtype | None = None,
    device: torch.device = CPU,
    kernels_choice: str = "portable",
) -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(0)
    config = ModelConfig(
        hidden_size=256,
        num_hidden_layers=2,
        indexer_types=["full", "shared"],
        mlp_layer_types=["dense", "dense"],
        **GLM5,
    )
    attn = MLAttention(config, 0, 0).to(device, dtype).eval()
    blocks = -(-context // BLOCK)
    layout = KVLayout(1, 512, 64, 128, (0,), BLOCK, blocks, 0, dtype, device, index_dtype)
    cache = PagedKVStorage(layout)
    cache.fp_kv[0] = torch.randn(cache.fp_kv.shape[1:], generator=g).to(device, dtype)
    cache.fp_index[0] = torch.randn(cache.fp_index.shape[1:], generator=g).to(device, cache.fp_index.dtype)
    table = list(range(blocks))  # an unfragmented pool hands out consecutive blocks
    q_lat = torch.randn(1, 64, 512, generator=g).to(device, dtype)
    q_rope = torch.randn(1, 64, 64, generator=g).to(device, dtype)
    iq, iw = torch.randn(1, 32, 128, generator=g).to(device), torch.randn(1, 32, generator=g).to(device)
    group = DecodeGroup(1, torch.tensor([table], device=device), torch.tensor([context], device=device), context,
                        tables=[table], lengths=[context])  # fmt: skip
    batch = ForwardBatch(
        torch.zeros(1, dtype=torch.long, device=device), torch.tensor([context - 1], device=device),
        torch.tensor([0], device=device), group, [], torch.tensor([0], device=device),
    )  # fmt: skip
    kernels = kernels_for(device, kernels_choice)
    dense_kernels = PortableKernels()

    def select(paged_min: int) -> Any:
        controls = DSAControls(dense_warmup_tokens=0, paged_scoring_min_tokens=paged_min)
        return _Selector(attn, cache, kernels, controls, 2048, (iq, iw), batch).decode()

    def sparse(paged_min: int) -> None:
        attn._attend(select(paged_min), q_lat, q_rope, cache, kernels, batch, [])

    pick = select(0)
    valid_all = torch.ones(1, context, dtype=torch.bool, device=device)

    def dense() -> None:
        dense_kernels.dense_mla(q_lat, q_rope, cache.fp_kv[0, :context], valid_all, attn.scale)

    def shared() -> None:
        attn._attend(pick, q_lat, q_rope, cache, kernels, batch, [])

    with torch.inference_mode():
        fns = {"dense": dense, "gather": lambda: sparse(1 << 40), "sparse": lambda: sparse(0), "shared": shared}
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        return interleaved(fns, repeats, sync)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--index-dtype", choices=["bfloat16", "float32"], help="indexer keys (default: --dtype)")
    ap.add_argument("--contexts", default="4096,16384,65536,131072")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--kernels", default="portable", choices=["auto", "portable", "triton"])
    ap.add_argument(
        "--allocator",
        default="retain",
        choices=["retain", "system"],
        help="retain: keep freed host memory in the process, as the worker does (glm5.allocator)",
    )
    ap.add_argument("--smoke", action="store_true", help="4096 tokens, 3 rounds, 1 thread, bfloat16 and float32")
    a = ap.parse_args()
    if a.smoke:
        a.contexts, a.repeats, a.threads = "4096", 3, 1
        for dtype in ("bfloat16", "float32"):
            a.dtype = dtype
            rows = run(a)
            assert rows == 1, rows  # the table, not the speed
        print("smoke: ok")
        return
    run(a)


def run(a: argparse.Namespace) -> int:
    """Prints the table; the number of rows."""
    torch.set_num_threads(a.threads)
    if a.allocator == "retain":
        retain_freed_memory()
    dtype = getattr(torch, a.dtype)
    index_dtype = getattr(torch, a.index_dtype) if a.index_dtype else dtype
    b, bi = dtype.itemsize, index_dtype.itemsize
    print(
        f"decode attention, GLM-5 sizes, {a.dtype} (indexer keys {index_dtype}), {a.device}, {a.kernels} kernels, "
        f"{a.threads} threads; medians of "
        f"{a.repeats} interleaved rounds (ms), {a.allocator} allocator; ratios are medians of per-round ratios"
    )
    print(
        f"{'context':>8} {'dense':>8} {'gather':>8} {'sparse':>8} {'shared':>8} {'dense/gather':>13} "
        f"{'dense/sparse':>13} {'dense/(F+S)/2':>14} {'MB dense':>9} {'MB sparse':>10}"
    )
    rows = 0
    for t in (int(x) for x in a.contexts.split(",")):
        runs = bench(t, dtype, a.repeats, index_dtype, torch.device(a.device), a.kernels)
        r = {name: statistics.median(v) for name, v in runs.items()}
        ratio = {
            "gather": statistics.median(d / g for d, g in zip(runs["dense"], runs["gather"], strict=True)),
            "sparse": statistics.median(d / s for d, s in zip(runs["dense"], runs["sparse"], strict=True)),
            "pair": statistics.median(
                2 * d / (s + h) for d, s, h in zip(runs["dense"], runs["sparse"], runs["shared"], strict=True)
            ),
        }
        mb_dense = t * 576 * b / 2**20
        mb_sparse = (t * 128 * bi + 2048 * 576 * b) / 2**20
        print(
            f"{t:>8} {r['dense']:>8.2f} {r['gather']:>8.2f} {r['sparse']:>8.2f} {r['shared']:>8.2f} "
            f"{ratio['gather']:>12.1f}x {ratio['sparse']:>12.1f}x {ratio['pair']:>13.1f}x {mb_dense:>9.1f} "
            f"{mb_sparse:>10.1f}",
            flush=True,
        )
        rows += 1
    return rows


if __name__ == "__main__":
    main()
