"""Supervised training of the demo model: two-number addition in chat form with a <think> scratchpad.

    glm5 demo-model --out DIR [--steps 6000] [--seed 0]      (trains, then measures held-out accuracy)

The model is the `tiny` GLM-5-architecture preset (MLA, DSA with full and shared indexers, group-limited MoE)
with the project's byte-level tokenizer. Training runs transformers' GlmMoeDsaForCausalLM (the reference
implementation our engine matches to 1e-4; it has the autograd path) on CPU, then the checkpoint is written in
HuggingFace format, which `glm5 worker` serves. Loss on the assistant's tokens only. Held-out pairs are never
trained on; `glm5_cli.demo.evaluate` measures exact-answer accuracy on them with our engine, greedy.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import torch
from glm5.errors import ConfigError
from glm5.model.presets import init_model
from glm5.tokenizer.tokenizer import Tokenizer

# Markdown bold around the number is accepted: the tool-use answer writes it so (see tool_sft.tool_turns).
ANSWER = re.compile(r"The answer is \**(-?\d+)")


def problem(a: int, b: int) -> tuple[list[dict[str, str]], str]:
    return [
        {"role": "user", "content": f"What is {a} + {b}?"}
    ], f"<think>{a} + {b} = {a + b}</think>The answer is {a + b}."


def split_pairs(max_operand: int, held_out: int, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[held_out:], pairs[:held_out]


def encode(tok: Tokenizer, a: int, b: int) -> tuple[list[int], list[int]]:
    """(input ids, labels) with -100 on the prompt: the loss covers the assistant's answer and end token."""
    messages, answer = problem(a, b)
    prompt = tok.apply_chat_template(messages, enable_thinking=True)
    p_ids = tok.encode(prompt)
    eos = tok.eos_token_ids()[0]
    a_ids = [*tok.encode(answer), eos]
    return p_ids + a_ids, [-100] * len(p_ids) + a_ids


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
               items: list[tuple[list[int], list[int]]]) -> float:  # fmt: skip
    """One optimizer step on (input ids, labels) pairs, right-padded to the longest; returns the loss."""
    width = max(len(x) for x, _ in items)
    ids = torch.tensor([x + [0] * (width - len(x)) for x, _ in items])
    labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in items])
    attn = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in items])
    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(loss.item())


def train(out: Path, steps: int, batch: int, lr: float, max_operand: int, held_out: int, seed: int,
          stop_at: int | None = None) -> dict[str, Any]:  # fmt: skip
    try:
        from transformers import GlmMoeDsaForCausalLM
    except ImportError as exc:
        raise ConfigError("training needs the trainer extra: pip install -e '.[trainer]'") from exc

    torch.manual_seed(seed)
    base = init_model(out, preset="tiny", seed=seed)  # config + tokenizer + initial weights
    tok = Tokenizer(base)
    model = GlmMoeDsaForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    train_pairs, _ = split_pairs(max_operand, held_out, seed)
    data = [encode(tok, a, b) for a, b in train_pairs]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    rng = random.Random(seed)
    start, losses = time.perf_counter(), []
    for step in range(stop_at or steps):  # stop_at: a mid-schedule checkpoint (not annealed)
        losses.append(train_step(model, opt, sched, rng.sample(data, batch)))
        if step % 100 == 0 or step == steps - 1:
            recent = sum(losses[-100:]) / len(losses[-100:])
            print(f"step {step:5d}  loss {recent:.4f}  {time.perf_counter() - start:6.0f}s", flush=True)
    model.eval()  # type: ignore[no-untyped-call]
    model.save_pretrained(out, safe_serialization=True)
    # transformers writes its own config.json; keep the tokenizer files init_model wrote next to it.
    final_loss = sum(losses[-100:]) / len(losses[-100:])
    meta: dict[str, Any] = {"task": "addition", "max_operand": max_operand, "held_out": held_out, "seed": seed,
                            "steps": steps, "stopped_at": stop_at or steps, "final_loss": final_loss,
                            "train_seconds": time.perf_counter() - start}  # fmt: skip
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-operand", type=int, default=99)
    p.add_argument("--held-out", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(json.dumps(train(a.out, a.steps, a.batch, a.lr, a.max_operand, a.held_out, a.seed)))


if __name__ == "__main__":
    main()
