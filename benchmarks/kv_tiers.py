"""KV bytes per token for each tier setting, and the logit drift the lossy tiers cause.

Bytes: latent + rope key + indexer key over all layers, from the engine's own layout (KVLayout), for GLM-5
sizes and for the tiny preset, averaged over a sequence of the given length (L1 keeps the most recent 128
tokens, block-granular), against the same cache held entirely in bfloat16.

Drift: the same bfloat16 model and prompt run through the engine with the cache entirely at model
precision, with the INT8 L2 tier (the default), and with an L3 prototype (tokens older than 2048 kept at
4-bit precision: INT8 values rounded to multiples of 16, simulating a 4-bit code with the same scales).
Prompt logits are captured at every position (prefill in 256-token chunks, so later chunks read older
tokens from the lossy tiers); the table gives max and mean absolute logit drift and argmax changes.

`--prompt problems` measures the INT8 tier where a trained model is in distribution: the shipped demo model's
held-out addition problems, teacher-forced with their answers, with `l1_tokens` 0 and 8-token blocks and chunks
so every earlier token is read back from INT8; drift is reported at the positions the model was trained to
predict (the answer and end token), against the all-precision cache, next to the drift of a float32 model's
cache held in bfloat16 or float16 (`--kv-cache-dtype`, no INT8 tier: the cache the bytes are compared against)
and between running the model in bfloat16 and in float32 (the noise floor of bfloat16 itself).

Usage: python benchmarks/kv_tiers.py [--prompt-len 4096] [--model DIR] [--prompt random|addition|problems]
       python benchmarks/kv_tiers.py --smoke     # both drift tables: a 2304-token random prompt, 4 problems

The engines here only prefill (every logit comes from a prompt), so they run eagerly: compiling decode steps
that never run would cost each engine its start-up compile.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from glm5.model.config import ModelConfig
from glm5.model.presets import PRESETS, default_model_path, init_model
from glm5_worker.config import EngineConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams
from glm5_worker.kv.sizing import make_layout

GLM5 = ModelConfig(indexer_types=["full"] * 78, mlp_layer_types=["dense"] * 3 + ["sparse"] * 75)
L3_AFTER = 2048


def bytes_per_token(config: ModelConfig, context: int, l2: bool, l3: bool, block: int = 64, l1: int = 128) -> float:
    layout = make_layout(config, block, 1, 1, torch.bfloat16, torch.device("cpu"))
    fp, q = layout.fp_bytes_per_token(), layout.q_bytes_per_token()
    # 4-bit values, same float16 scales
    values = config.num_hidden_layers * config.kv_cache_dim + config.num_full_indexer_layers * config.index_head_dim
    q4 = q - values + values / 2
    if not l2:
        return float(fp)
    n_l1 = min(context, (l1 // block + 1) * block)  # the window plus the block being filled
    older = context - n_l1
    n_l3 = max(0, context - L3_AFTER) if l3 else 0
    n_l2 = older - min(n_l3, older)
    return (n_l1 * fp + n_l2 * q + min(n_l3, older) * q4) / context


class LogitRecorder:
    def __init__(self, engine: Engine) -> None:
        self.rows: list[torch.Tensor] = []
        model = engine.model
        original = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.rows.append(out.detach().float().clone())
            return out

        model.forward = forward  # type: ignore[method-assign]


def simulate_l3(engine: Engine) -> None:
    """Rounds the L2 copies of tokens older than L3_AFTER to 4-bit precision (prototype, not in the engine)."""
    bm, st = engine.blocks, engine.storage
    bs = bm.block_size
    for seq in engine.requests.values():
        newest = seq.num_computed_tokens
        for j, b in enumerate(seq.block_table):
            if bm.is_q(b) and (j + 1) * bs <= newest - L3_AFTER:
                rows = slice((b - bm.num_fp) * bs, (b - bm.num_fp + 1) * bs)
                st.q_kv[:, rows] = (torch.round(st.q_kv[:, rows].float() / 16) * 16).clamp(-127, 127).to(torch.int8)
                st.q_index[:, rows] = (
                    (torch.round(st.q_index[:, rows].float() / 16) * 16).clamp(-127, 127).to(torch.int8)
                )


def prompt_logits(model: Path, prompt: list[int], l2: bool, l3: bool, dtype: str = "bfloat16") -> torch.Tensor:
    engine = Engine(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            max_model_len=len(prompt) + 8,
            kv_cache_bytes=256 << 20,
            kv_int8_tier=l2,
            max_num_batched_tokens=256,
            enable_prefix_caching=False,
            enforce_eager=True,
        )
    )
    rec = LogitRecorder(engine)
    engine.add_request("p", None, prompt, SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=True))
    while engine.has_work:
        engine.step()
        if l3:
            simulate_l3(engine)
    return torch.cat(rec.rows)[: len(prompt) - 1]


def problem_logits(model: Path, seqs: list[list[int]], l2: bool, dtype: str, kv_dtype: str = "auto") -> torch.Tensor:
    """Teacher-forced logits of each sequence, every token but the current 8-token chunk read from the cache
    (L1 in `kv_dtype`, the worker's --kv-cache-dtype)."""
    engine = Engine(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            max_model_len=max(map(len, seqs)) + 8,
            kv_cache_bytes=64 << 20,
            kv_int8_tier=l2,
            l1_tokens=0,
            block_size=8,
            max_num_batched_tokens=8,
            enable_prefix_caching=False,
            enforce_eager=True,
        )
    )
    rec, out = LogitRecorder(engine), []
    for i, seq in enumerate(seqs):
        rec.rows.clear()
        engine.add_request(f"p{i}", None, seq, SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=True))
        while engine.has_work:
            engine.step()
        out.append(torch.cat(rec.rows)[: len(seq) - 1])
    return torch.cat(out)


def problems_drift(model: Path, count: int) -> int:
    """Prints the table; its number of rows."""
    from glm5.tokenizer.tokenizer import Tokenizer
    from glm5_trainer.sft import encode, split_pairs

    tok = Tokenizer(model)
    _, held_out = split_pairs(99, 500, 0)
    encoded = [encode(tok, a, b) for a, b in held_out[:count]]
    seqs = [ids for ids, _ in encoded]
    # logits row i predicts token i + 1: keep the rows whose next token is a trained label
    answer = torch.cat([torch.tensor([label != -100 for label in labels[1:]]) for _, labels in encoded])
    print(f"\nlogit drift at the answer positions of {count} held-out problems ({int(answer.sum())} positions), "
          f"{model.name}, every earlier token read from the cache")  # fmt: skip
    print(f"{'model':>9} {'cache':>26} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9} {'mean':>9} {'argmax changed':>15}")
    ref = {dtype: problem_logits(model, seqs, l2=False, dtype=dtype) for dtype in ("float32", "bfloat16")}

    def cache(kv_dtype: str) -> torch.Tensor:  # float32 model, no tier, L1 in kv_dtype
        return problem_logits(model, seqs, l2=False, dtype="float32", kv_dtype=kv_dtype)

    rows = (
        ("float32", "INT8 tier", problem_logits(model, seqs, l2=True, dtype="float32"), ref["float32"]),
        ("float32", "bfloat16 cache, no tier", cache("bfloat16"), ref["float32"]),
        ("float32", "float16 cache, no tier", cache("float16"), ref["float32"]),
        ("bfloat16", "INT8 tier", problem_logits(model, seqs, l2=True, dtype="bfloat16"), ref["bfloat16"]),
        ("bfloat16", "no tier (vs float32 model)", ref["bfloat16"], ref["float32"]),
    )
    for dtype, label, got, base in rows:
        d = (got - base).abs()[answer]
        q = torch.quantile(d.max(dim=-1).values, torch.tensor([0.5, 0.9, 0.99])).tolist()
        changed = (got[answer].argmax(-1) != base[answer].argmax(-1)).float().mean()
        print(f"{dtype:>9} {label:>26} {q[0]:>9.2e} {q[1]:>9.2e} {q[2]:>9.2e} {d.max():>9.2e} {d.mean():>9.2e} "
              f"{changed:>14.2%}")  # fmt: skip
    return len(rows)


def addition_chat(model: Path, length: int) -> list[int]:
    """A multi-turn chat of addition problems with their answers, `length` tokens long."""
    import random

    from glm5.tokenizer.tokenizer import Tokenizer

    tok, rng, messages = Tokenizer(model), random.Random(0), []
    while True:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        answer = {
            "role": "assistant",
            "reasoning_content": f"{a} + {b} = {a + b}",
            "content": f"The answer is {a + b}.",
        }
        messages += [{"role": "user", "content": f"What is {a} + {b}?"}, answer]
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False))
        if len(ids) >= length:
            return ids[:length]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--model", help="checkpoint (default: a fresh tiny preset, seed 0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--problems", type=int, default=200, help="--prompt problems: how many held-out problems")
    ap.add_argument("--prompt", choices=["random", "addition", "problems"], default="random",
                    help="random token ids; a long multi-turn chat of addition problems (longer than anything the "
                    "demo model was trained on); or held-out problems (in distribution for the shipped demo "
                    "model, the default --model then)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true",
                    help="a 2304-token random prompt, then 4 held-out problems (demo model); 1 thread")  # fmt: skip
    a = ap.parse_args()
    if a.smoke:
        a.prompt_len, a.problems, a.threads, a.prompt = 2304, 4, 1, "random"  # L3 from 2048 + a block
    torch.set_num_threads(a.threads)
    tiny = ModelConfig(vocab_size=1024, **PRESETS["tiny"])
    print("KV bytes per token (latent + rope key + indexer key, all layers), relative to the cache in bfloat16")
    print(f"{'model':>6} {'context':>8} {'bf16 B':>8} {'L1+L2 B':>9} {'ratio':>6} {'L1+L2+L3 B':>11} {'ratio':>6}")
    for name, config in (("GLM-5", GLM5), ("tiny", tiny)):
        for ctx in (4096, 32768, 131072):
            base = bytes_per_token(config, ctx, False, False)
            l2, l3 = bytes_per_token(config, ctx, True, False), bytes_per_token(config, ctx, True, True)
            print(f"{name:>6} {ctx:>8} {base:>8.0f} {l2:>9.0f} {l2 / base:>6.3f} {l3:>11.0f} {l3 / base:>6.3f}")
    if a.prompt == "problems":
        problems_drift(Path(a.model) if a.model else default_model_path(), a.problems)
        return
    rows = drift(a)
    if a.smoke:  # the tables, not the figures
        assert rows == 3, rows
        assert problems_drift(default_model_path(), a.problems) == 5
        print("smoke: ok")


def drift(a: argparse.Namespace) -> int:
    """The random or addition prompt's drift table; its number of rows."""
    model = Path(a.model) if a.model else init_model(Path(tempfile.mkdtemp()) / "tiny", preset="tiny", seed=0)
    if a.prompt == "addition":
        prompt = addition_chat(model, a.prompt_len)
    else:
        prompt = torch.randint(20, 1000, (a.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = prompt_logits(model, prompt, l2=False, l3=False)
    print(
        f"\nlogit drift vs the all-bfloat16 cache, {model.name}, {a.prompt_len}-token prompt, bfloat16 model "
        f"(logit std {ref.std():.3f}, max |logit| {ref.abs().max():.3f})"
    )
    print(f"{'tiers':>10} {'max |drift|':>12} {'mean |drift|':>13} {'argmax changed':>15}")
    rows = (
        ("L1+L2", True, False, "bfloat16"),
        ("L1+L2+L3", True, True, "bfloat16"),
        ("fp32 model", False, False, "float32"),
    )  # the last row: the noise floor of bfloat16 itself
    for label, l2, l3, dtype in rows:
        got = prompt_logits(model, prompt, l2=l2, l3=l3, dtype=dtype)
        d = (got - ref).abs()
        changed = (got.argmax(-1) != ref.argmax(-1)).float().mean()
        print(f"{label:>10} {d.max():>12.2e} {d.mean():>13.2e} {changed:>14.2%}")
    return len(rows)


if __name__ == "__main__":
    main()
