"""`glm5 export-demo`: the shipped demo model and its addition problems as files, to put on a volume (a cluster's
model and dataset claims: charts/glm5/examples/demo-data.yaml runs it as a Job)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from glm5.errors import ConfigError
from glm5.model.presets import SHIPPED_MODEL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="copy the demo checkpoint (weights, config, tokenizer) into this folder")
    p.add_argument("--dataset", type=Path, help="write the addition problems here as JSONL (`glm5 trainer "
                   "--dataset`; the held-out ones marked split: eval)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="replace what is already there")


def run(a: argparse.Namespace) -> None:
    if a.model is None and a.dataset is None:
        raise ConfigError("give --model DIR and/or --dataset FILE")
    if a.model is not None:
        print(f"demo model -> {export_model(a.model, a.force)}")
    if a.dataset is not None:
        train, held_out = export_dataset(a.dataset, a.force)
        print(f"addition problems -> {a.dataset} ({train} to train on, {held_out} held out)")


def export_model(out: Path, force: bool = False) -> Path:
    """Copies the checkpoint's files into `out` (which may be a mounted, already existing empty folder)."""
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in SHIPPED_MODEL.iterdir() if p.is_file())
    clashes = [p.name for p in files if (out / p.name).exists()]
    if clashes and not force:
        raise ConfigError(f"{out} already holds {', '.join(clashes)}: pass --force to replace them")
    for p in files:
        shutil.copyfile(p, out / p.name)
    return out


def export_dataset(path: Path, force: bool = False) -> tuple[int, int]:
    from glm5_trainer.environment import builtin_problems

    if path.exists() and not force:
        raise ConfigError(f"{path} exists: pass --force to replace it")
    train, held_out = builtin_problems()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for split, problems in (("train", train), ("eval", held_out)):
            for p in problems:
                item = {"id": p.id, "messages": list(p.messages), "answer": p.answer, "split": split}
                f.write(json.dumps(item) + "\n")
    return len(train), len(held_out)
