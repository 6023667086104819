"""`glm5 demo-model`: train the shipped demo model (glm5_trainer.sft) and measure it with our own engine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from glm5_trainer.sft import ANSWER, problem, split_pairs, train
from glm5_worker.config import EngineConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-operand", type=int, default=99)
    p.add_argument("--held-out", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-at", type=int, help="stop (and save) at this step of the --steps schedule")
    p.add_argument("--eval-only", action="store_true", help="only measure an existing checkpoint")


def evaluate(model_dir: Path, max_operand: int, held_out: int, seed: int, limit: int | None = None) -> float:
    """Exact-answer accuracy on the held-out pairs, greedy, served by our own engine."""
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=256, kv_cache_bytes=64 << 20, max_num_seqs=64))
    _, test_pairs = split_pairs(max_operand, held_out, seed)
    test_pairs = test_pairs[:limit] if limit else test_pairs
    texts: dict[str, str] = {}
    for i, (a, b) in enumerate(test_pairs):
        prompt = engine.tokenizer.apply_chat_template(problem(a, b)[0], enable_thinking=True)
        engine.add_request(f"q{i}", prompt, None, SamplingParams(temperature=0, max_new_tokens=40))
        texts[f"q{i}"] = ""
    while engine.has_work:
        for out in engine.step():
            texts[out.request_id] += out.text
    correct = 0
    for i, (a, b) in enumerate(test_pairs):
        m = ANSWER.search(texts[f"q{i}"])
        correct += bool(m) and int(m.group(1)) == a + b  # type: ignore[union-attr]
    return correct / len(test_pairs)


def run(a: argparse.Namespace) -> None:
    if not a.eval_only:
        print(json.dumps(train(a.out, a.steps, a.batch, a.lr, a.max_operand, a.held_out, a.seed, a.stop_at)))
    print(f"held-out accuracy: {evaluate(a.out, a.max_operand, a.held_out, a.seed):.1%}")
