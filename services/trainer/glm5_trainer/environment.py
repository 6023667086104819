"""Reward environments: problems with a verifiable answer, and the reward of a generated answer.

`addition` (the demo model's task): the answer is right when the text holds "The answer is N" with the expected
N; reward 1.0, else 0.0. Problems come from `--dataset builtin` (the demo model's training split of
two-number additions; the held-out pairs are kept for evaluation) or a JSONL file, one problem per line:

    {"prompt": "What is 12 + 30?", "answer": "42"}
    {"messages": [{"role": "user", "content": "..."}], "answer": "7", "split": "eval"}

Lines with `"split": "eval"` are held out for evaluation; every other line is trained on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5.errors import ConfigError

from glm5_trainer.sft import ANSWER, problem, split_pairs

BUILTIN = "builtin"


@dataclass(frozen=True, slots=True)
class Problem:
    id: str
    messages: tuple[dict[str, str], ...]
    answer: str


class ExactAnswer:
    """Reward 1.0 when the first "The answer is N" in the text names the expected answer."""

    name = "addition"
    pattern: re.Pattern[str] = ANSWER

    def reward(self, p: Problem, text: str) -> float:
        m = self.pattern.search(text)
        return 1.0 if m is not None and m.group(1) == p.answer else 0.0


ENVIRONMENTS: dict[str, type[ExactAnswer]] = {"addition": ExactAnswer}


def environment(name: str) -> ExactAnswer:
    if name not in ENVIRONMENTS:
        raise ConfigError(f"unknown environment {name!r} (known: {sorted(ENVIRONMENTS)})")
    return ENVIRONMENTS[name]()


def builtin_problems(max_operand: int = 99, held_out: int = 500, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """The demo model's split: (training problems, held-out problems)."""
    train, test = split_pairs(max_operand, held_out, seed)

    def make(a: int, b: int) -> Problem:
        return Problem(f"{a}+{b}", tuple(problem(a, b)[0]), str(a + b))

    return [make(a, b) for a, b in train], [make(a, b) for a, b in test]


def _parse_line(path: Path, n: int, line: str) -> tuple[Problem, bool]:
    where = f"{path}:{n}"
    try:
        item: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: each line must be a JSON object")
    if "answer" not in item or not isinstance(item["answer"], (str, int)) or isinstance(item["answer"], bool):
        raise ConfigError(f"{where}: 'answer' (a string or an integer) is required")
    if isinstance(item.get("prompt"), str) and "messages" not in item:
        messages: list[Any] = [{"role": "user", "content": item["prompt"]}]
    elif isinstance(item.get("messages"), list) and item["messages"]:
        messages = item["messages"]
    else:
        raise ConfigError(f"{where}: give 'prompt' (a string) or 'messages' (a non-empty list)")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: every message needs string 'role' and 'content'")
    split = item.get("split", "train")
    if split not in ("train", "eval"):
        raise ConfigError(f"{where}: 'split' must be 'train' or 'eval', got {split!r}")
    return Problem(str(item.get("id", n)), tuple(messages), str(item["answer"])), split == "eval"


def load_problems(dataset: str, held_out: int = 500, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(training problems, evaluation problems) from `builtin` or a JSONL file; errors name the line."""
    if dataset == BUILTIN:
        return builtin_problems(held_out=held_out, seed=seed)
    path = Path(dataset)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read dataset {path}: {exc.strerror}") from exc
    train: list[Problem] = []
    evaluation: list[Problem] = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            p, is_eval = _parse_line(path, n, line)
            (evaluation if is_eval else train).append(p)
    if not train:
        raise ConfigError(f"dataset {path} has no training problems")
    return train, evaluation
