"""`glm5 demo-model`: train the shipped demo model and measure it with our own engine.

Two stages, one command: supervised training (glm5_trainer.sft) for `--stop-at` steps of a `--steps`-step
schedule, then `--rl-steps` steps of the asynchronous RL loop (`glm5 rl`: rollout workers, TITO gateway,
trainer) from that checkpoint; the last synced RL version becomes the model in `--out`, with `training.json`
(both stages, accuracy before and after RL) and the run's `rl.png` next to the work folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from glm5.errors import ConfigError
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
    p.add_argument("--stop-at", type=int, default=3500,
                   help="stop supervised training (and save) at this step of the --steps schedule")  # fmt: skip
    p.add_argument("--rl-steps", type=int, default=200, help="RL steps after supervised training (0: none)")
    p.add_argument("--rl-lr", type=float, default=1e-4)
    p.add_argument("--rl-seed", type=int, default=0, help="RL problem order and sampling (the split is --seed's)")
    p.add_argument("--work", type=Path, help="stage folders (default: OUT.work)")
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


def _rl(sft: Path, work: Path, a: argparse.Namespace) -> dict[str, object]:
    out = work / "rl"
    cmd = [sys.executable, "-m", "glm5_cli", "rl", "--model", str(sft), "--workers", "2", "--out", str(out),
           "--steps", str(a.rl_steps), "--learning-rate", str(a.rl_lr), "--seed", str(a.rl_seed),
           f"--trainer-arg=--split-seed={a.seed}",
           "--worker-arg=--kv-cache-bytes=64MiB", "--worker-arg=--max-model-len=256",
           f"--trainer-arg=--eval-size={a.held_out}", "--trainer-arg=--eval-every=50",
           "--trainer-arg=--lr-schedule=cosine"]  # fmt: skip
    if subprocess.run(cmd).returncode:
        raise ConfigError("the RL stage failed (its log is above)")
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    return summary


def run(a: argparse.Namespace) -> None:
    if a.eval_only:
        print(f"held-out accuracy: {evaluate(a.out, a.max_operand, a.held_out, a.seed):.1%}")
        return
    if a.rl_steps < 0 or (a.stop_at is not None and not 0 < a.stop_at <= a.steps):
        raise ConfigError("--rl-steps >= 0 and 0 < --stop-at <= --steps")
    if a.rl_steps and (a.max_operand != 99 or a.held_out > 500):
        raise ConfigError("the RL stage trains on the built-in split: --max-operand 99 and --held-out <= 500")
    if not a.rl_steps:
        print(json.dumps(train(a.out, a.steps, a.batch, a.lr, a.max_operand, a.held_out, a.seed, a.stop_at)))
        print(f"held-out accuracy: {evaluate(a.out, a.max_operand, a.held_out, a.seed):.1%}")
        return
    work = a.work or a.out.with_name(a.out.name + ".work")
    sft = work / "sft"
    meta: dict[str, object] = {"task": "addition", "max_operand": a.max_operand, "held_out": a.held_out, "seed": a.seed}
    meta["sft"] = train(sft, a.steps, a.batch, a.lr, a.max_operand, a.held_out, a.seed, a.stop_at)
    summary = _rl(sft, work, a)
    final = Path(str(summary["final_checkpoint"]))
    a.out.mkdir(parents=True, exist_ok=True)
    for f in final.iterdir():
        if f.is_file() and f.name != "version.json":
            shutil.copyfile(f, a.out / f.name)  # not the 0600 mode transformers writes
    kept = ("accuracy_before", "accuracy_after", "train_seconds", "final_version")
    meta["rl"] = {
        "steps": a.rl_steps,
        "learning_rate": a.rl_lr,
        "lr_schedule": "cosine",
        "seed": a.rl_seed,
        **{k: summary[k] for k in kept},
    }
    (a.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"held-out accuracy: SFT {summary['accuracy_before']:.1%} -> RL {summary['accuracy_after']:.1%}; the model "
          f"is in {a.out}, the RL run (history, rl.png) in {work / 'rl'}")  # fmt: skip
