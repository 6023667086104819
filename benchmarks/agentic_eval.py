"""Held-out evaluation of a demo checkpoint as a tool user: the `tools` environment's 500 held-out calculator
problems (multi-turn: the model calls `add` / `multiply`, the environment answers, the model answers) and the 500
held-out plain additions (no tools), greedy, played on our own engine in this process (glm5_cli.demo.
play_offline). Prints, per model: final-answer accuracy on both sets, tool-call validity (parsed, registered,
schema-valid calls over all calls), calls to unregistered tools, malformed calls, mean turns, and the answers
to the README's first questions. `--variants` adds glm5_trainer.tool_family's evaluation sets: tools written
in ways training never saw, per operand size (1-2, 3, 4 digits, and all of them), with thinking off, and README's
tools without `additionalProperties`. `--tool-grammar` plays the tool sets as `glm5 serve` serves them under
tool_choice auto (the router's lazy tool-call grammar, RouterConfig.tool_call_grammar); `--both` plays them both
ways, the rows of the grammar marked "+ grammar".

Usage: python benchmarks/agentic_eval.py --model DIR [--model DIR ...] [--limit N] [--variants] [--tool-grammar |
       --both] [--smoke]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from glm5.model.presets import SHIPPED_MODEL
from glm5_cli.demo import play_offline
from glm5_trainer.environment import Problem, builtin_problems, tool_problems
from glm5_trainer.tool_family import evaluation_sets

FIRST_QUESTIONS = [(1, 1), (1, 2), (2, 2), (12, 30)]


def first_answers(model: Path) -> str:
    """How many of the README's first questions the model answers right (greedy)."""
    problems = [Problem(f"{a}+{b}", ({"role": "user", "content": f"What is {a} + {b}?"},), str(a + b))
                for a, b in FIRST_QUESTIONS]  # fmt: skip
    s = play_offline(model, "addition", problems, max_new_tokens=40)
    return f"{s['accuracy']:.0%} right"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, action="append", help="checkpoint (repeatable; default: the shipped one)")
    p.add_argument("--limit", type=int, help="problems per set (default: all 500)")
    p.add_argument("--variants", action="store_true", help="also the held-out tool variants (tool_family)")
    p.add_argument("--tool-grammar", action="store_true", help="the tool sets under the lazy tool-call grammar")
    p.add_argument("--both", action="store_true", help="the tool sets without and with the grammar")
    p.add_argument("--smoke", action="store_true", help="8 problems per set, the variants too: checks the path only")
    a = p.parse_args()
    if a.smoke:
        a.limit, a.variants, a.both = 8, True, True
    modes = [False, True] if a.both else [a.tool_grammar]
    _, tools_held_out = tool_problems()
    _, additions_held_out = builtin_problems()
    print("| model | set | problems | accuracy | tool-call validity | unknown calls | malformed | mean turns | s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model in a.model or [SHIPPED_MODEL]:
        sets = [("tools", "tools", tools_held_out, g) for g in modes]
        sets.append(("addition", "addition", additions_held_out, False))
        for name, env, problems, grammar in sets:
            start = time.perf_counter()
            s = play_offline(model, env, problems[: a.limit] if a.limit else problems, tool_grammar=grammar)
            row(model, name + (" + grammar" if grammar else ""), s, time.perf_counter() - start)
        print(f"| {model.name} | 1+1, 1+2, 2+2, 12+30 | 4 | {first_answers(model)} | | | | | |", flush=True)
        if a.variants:
            for grammar in modes:
                variants(model, a.limit, grammar)


def row(model: Path, name: str, s: dict[str, Any], seconds: float) -> None:
    validity = "-" if s["tool_call_validity"] is None else f"{s['tool_call_validity']:.1%}"
    print(f"| {model.name} | {name} | {s['problems']} | {s['accuracy']:.1%} | {validity} | {s['unknown_tool_calls']} "
          f"| {s['malformed_tool_calls']} | {s['mean_turns']:.2f} | {seconds:.0f} |", flush=True)  # fmt: skip


def variants(model: Path, limit: int | None, grammar: bool = False) -> None:
    """The tool_family sets, one row each, then the three operand buckets together."""
    buckets: list[dict[str, Any]] = []
    mark = " + grammar" if grammar else ""
    for name, problems in evaluation_sets().items():
        start = time.perf_counter()
        s = play_offline(model, "tools", problems[:limit] if limit else problems, max_new_tokens=64,
                         max_model_len=8192, tool_grammar=grammar)  # fmt: skip
        row(model, name + mark, s, time.perf_counter() - start)
        if "digits" in name:
            buckets.append(s)
    n = sum(s["problems"] for s in buckets)
    calls = sum(s["tool_calls"] for s in buckets)
    valid = sum(s["tool_calls"] * (s["tool_call_validity"] or 0) for s in buckets)
    total = {"problems": n, "accuracy": sum(s["accuracy"] * s["problems"] for s in buckets) / n,
             "tool_call_validity": valid / calls if calls else None,
             "unknown_tool_calls": sum(s["unknown_tool_calls"] for s in buckets),
             "malformed_tool_calls": sum(s["malformed_tool_calls"] for s in buckets),
             "mean_turns": sum(s["mean_turns"] * s["problems"] for s in buckets) / n}  # fmt: skip
    row(model, "held-out variants, all" + mark, total, 0)


if __name__ == "__main__":
    main()
