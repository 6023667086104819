"""Quantized checkpoints on this CPU: accuracy of the demo model per scheme, and decode speed per format.

Part 1 (--accuracy): the shipped demo model quantized with the default recipes (group size 32: its layers have
64-128 input columns) and scored on the README's 500 held-out addition problems (greedy, exact answer), next to
float32; weight bytes of the quantized layers before/after; argmax agreement and logit drift against float32,
teacher-forced over every position of the 500 problems with their reference answers.

Part 2 (--speed): a random model big enough for weight reads to matter (hidden 1024, 32 experts of 512, 4
layers; ~0.9 GB float32) in float32, bfloat16, fp8-block and w4a16 (float32 compute dequantizes a layer when it
runs; w4a16 in bfloat16 runs PyTorch's int4 CPU matmul): load time, weight bytes, decode tokens/s at batch 1 and
32 (128-token prompts, 64 new tokens, greedy, generated tokens over the decode wall time), median of --repeats.

Usage: python benchmarks/quantized.py [--accuracy] [--speed] [--repeats 3]
       python benchmarks/quantized.py --smoke     # both parts: 8 problems, 16 calibration prompts, a small model

Engines that only prefill (calibration, teacher forcing) run eagerly; the speed part's run as `glm5 worker` does
(decode steps compiled at start-up; eager with --smoke).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from glm5.model.loader import save_checkpoint
from glm5.model.model import GlmMoeDsaForCausalLM
from glm5.model.presets import SHIPPED_MODEL, init_weights, preset_config
from glm5.quantize.quantizer import quantize_checkpoint
from glm5.quantize.recipe import load_recipe
from glm5.tokenizer.build import write_tokenizer
from glm5_cli.demo import evaluate
from glm5_cli.quantize import collect_hessians, read_calibration
from glm5_worker.config import EngineConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams
from kv_tiers import LogitRecorder  # benchmarks/ is on the path: python benchmarks/quantized.py

CALIBRATION = SHIPPED_MODEL.parent / "calibration" / "addition.jsonl"
MEDIUM: dict[str, Any] = dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, n_routed_experts=32,
              num_experts_per_tok=4, n_group=4, topk_group=2, q_lora_rank=512, kv_lora_rank=256,
              num_attention_heads=8, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_n_heads=8,
              index_head_dim=64)  # fmt: skip
# --smoke: the same shape of model, small enough to write, quantize and run in seconds
SMALL: dict[str, Any] = dict(MEDIUM, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=128,
                             kv_lora_rank=128, num_attention_heads=4, index_n_heads=4)  # fmt: skip


def quiet(_: str) -> None:
    pass


@contextlib.contextmanager
def eager_by_default() -> Iterator[None]:
    """Engines built inside without a choice run eagerly (GLM5_ENFORCE_EAGER): glm5 quantize's calibration engine
    only prefills, but would compile decode steps at start-up."""
    before = os.environ.get("GLM5_ENFORCE_EAGER")
    os.environ["GLM5_ENFORCE_EAGER"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["GLM5_ENFORCE_EAGER"]
        else:
            os.environ["GLM5_ENFORCE_EAGER"] = before


def variants(src: Path, work: Path, group: int, prompts: int = 512) -> dict[str, tuple[Path, float]]:
    """name -> (checkpoint, bytes of its quantized layers / their float bytes)."""
    out: dict[str, tuple[Path, float]] = {"float32": (src, 1.0)}
    texts = read_calibration(CALIBRATION, prompts)
    runs = [("fp8-block", "fp8-block", False), ("w4a16 RTN", "w4a16", False), ("w4a16 GPTQ", "w4a16", True),
            ("w4a16-fp8-mix GPTQ", "w4a16-fp8-mix", True)]  # fmt: skip
    for name, scheme, calibrated in runs:
        recipe = load_recipe(scheme, None).with_group_size(group)
        with eager_by_default():
            hessians = collect_hessians(src, texts, recipe) if calibrated else None
        path = work / name.replace(" ", "-")
        summary = quantize_checkpoint(src, path, recipe, hessians=hessians, progress=False, log=quiet)
        out[name] = (path, summary.stored_bytes_quantized / summary.float_bytes_quantized)
    return out


def teacher_forced(model: Path, seqs: list[list[int]]) -> torch.Tensor:
    engine = Engine(EngineConfig(model=str(model), max_model_len=128, kv_cache_bytes=64 << 20,
                                 enable_prefix_caching=False, max_num_batched_tokens=128,
                                 enforce_eager=True))  # fmt: skip
    rec, out = LogitRecorder(engine), []
    for i, seq in enumerate(seqs):
        rec.rows.clear()
        engine.add_request(f"p{i}", None, seq, SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=True))
        while engine.has_work:
            engine.step()
        out.append(rec.rows[0][: len(seq) - 1])
    return torch.cat(out)


def accuracy(limit: int | None = None, prompts: int = 512) -> int:
    """Prints the table (the first `limit` held-out problems); its number of rows."""
    from glm5.tokenizer.tokenizer import Tokenizer
    from glm5_trainer.sft import encode, split_pairs

    tok = Tokenizer(SHIPPED_MODEL)
    _, held_out = split_pairs(99, 500, 0)
    encoded = [encode(tok, a, b) for a, b in held_out[:limit]]
    seqs = [ids for ids, _ in encoded]
    # positions whose next token is the answer's (the labels the model was trained on)
    answer = torch.tensor([label != -100 for _, labels in encoded for label in labels[1:]])
    with tempfile.TemporaryDirectory() as tmp:
        found = variants(SHIPPED_MODEL, Path(tmp), group=32, prompts=prompts)
        ref = teacher_forced(SHIPPED_MODEL, seqs)
        print(f"{'scheme':<22}{'held-out':>10}{'bytes (quantized layers)':>26}{'argmax agree':>14}"
              f"{'... on answers':>16}{'max |dlogit|':>14}{'mean |dlogit|':>15}")  # fmt: skip
        for name, (path, ratio) in found.items():
            acc = evaluate(path, 99, 500, 0, limit)
            logits = ref if name == "float32" else teacher_forced(path, seqs)
            same = logits.argmax(-1) == ref.argmax(-1)
            agree, on_answers = same.float().mean().item(), same[answer].float().mean().item()
            drift = (logits - ref).abs()
            print(f"{name:<22}{acc:>10.1%}{ratio:>25.3f}x{agree:>14.2%}{on_answers:>16.2%}{drift.max().item():>14.4f}"
                  f"{drift.mean().item():>15.5f}", flush=True)  # fmt: skip
    return len(found)


def medium_model(out: Path, dims: dict[str, Any] = MEDIUM) -> Path:
    tok = write_tokenizer(out, vocab_size=1024, seed=0)
    vocab = (tok.get_vocab_size(with_added_tokens=True) + 63) // 64 * 64
    model = GlmMoeDsaForCausalLM(preset_config("tiny", vocab, [0], **dims))
    init_weights(model, 0)
    save_checkpoint(model, out)
    return out


def decode_rate(model: Path, dtype: str, batch: int, new: int = 64, prompt: int = 128,
                eager: bool = False) -> tuple[float, float, int]:  # fmt: skip
    """(load seconds, generated tokens per second of decode, weight bytes)."""
    start = time.perf_counter()
    config = EngineConfig(model=str(model), dtype=dtype, max_model_len=prompt + new + 8, kv_cache_bytes=256 << 20,
                          max_num_seqs=64, enforce_eager=eager)  # fmt: skip
    engine = Engine(config)
    load = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(10, 1000, (prompt,), generator=gen).tolist()
        engine.add_request(f"r{i}", None, ids, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:  # the prefills (each request's first token comes from its prefill)
        started.update(o.request_id for o in engine.step() if o.token_ids)
    begin, produced = time.perf_counter(), 0
    while engine.has_work:
        produced += sum(len(o.token_ids) for o in engine.step())
    rate = produced / (time.perf_counter() - begin)
    weight_bytes = sum(engine.stats().ranks[0].weight_bytes_by_dtype.values())
    return load, rate, weight_bytes


def speed(repeats: int, smoke: bool = False) -> int:
    """Prints the table; its number of rows. `smoke`: the small model, batches 1 and 4, 8 new tokens, eager."""
    big, new = (4, 8) if smoke else (32, 64)
    with tempfile.TemporaryDirectory() as tmp:
        src = medium_model(Path(tmp) / "float", SMALL if smoke else MEDIUM)
        fp8 = Path(tmp) / "fp8"
        quantize_checkpoint(src, fp8, load_recipe("fp8-block", None), progress=False, log=quiet)
        w4 = Path(tmp) / "w4a16"
        quantize_checkpoint(src, w4, load_recipe("w4a16", None), progress=False, log=quiet)
        rows = [("float32", src, "float32"), ("bfloat16", src, "bfloat16"), ("fp8-block (f32 compute)", fp8, "float32"),
                ("fp8-block (bf16 compute)", fp8, "bfloat16"), ("w4a16 (f32 compute)", w4, "float32"),
                ("w4a16 (bf16, int4 kernel)", w4, "bfloat16")]  # fmt: skip
        print(f"{'format':<27}{'weights MB':>11}{'load s':>8}{'tok/s b=1':>11}{f'tok/s b={big}':>12}"
              f"{'b=1 vs f32':>12}")  # fmt: skip
        base = None
        for name, path, dtype in rows:
            runs1 = [decode_rate(path, dtype, 1, new, eager=smoke) for _ in range(repeats)]
            runs32 = [decode_rate(path, dtype, big, new, eager=smoke)[1] for _ in range(repeats)]
            load = statistics.median(r[0] for r in runs1)
            r1, r32 = statistics.median(r[1] for r in runs1), statistics.median(runs32)
            base = base or r1
            print(
                f"{name:<27}{runs1[0][2] / 1e6:>11.0f}{load:>8.2f}{r1:>11.1f}{r32:>12.1f}{r1 / base:>11.2f}x",
                flush=True,
            )
    return len(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--accuracy", action="store_true")
    p.add_argument("--speed", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true",
                   help="both parts: 8 problems, 16 calibration prompts, a small model, eager, 1 thread")  # fmt: skip
    a = p.parse_args()
    if a.smoke:  # the tables, not the figures
        torch.set_num_threads(1)
        assert accuracy(limit=8, prompts=16) == 5
        assert speed(1, smoke=True) == 6
        print("smoke: ok")
        return
    torch.set_num_threads(2)
    if a.accuracy or not a.speed:
        accuracy()
    if a.speed or not a.accuracy:
        speed(a.repeats)


if __name__ == "__main__":
    main()
