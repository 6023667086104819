"""`glm5 demo-model`: train the shipped demo model and measure it with our own engine.

Stages, one command: supervised training (glm5_trainer.sft) for `--stop-at` steps of a `--steps`-step
schedule, then `--rl-steps` steps of the asynchronous RL loop (`glm5 rl`: rollout workers, TITO gateway,
trainer) from that checkpoint, then (`--tool-steps`) supervised tool use (glm5_trainer.tool_sft) on top, then
(`--tool-rl-steps`) `glm5 rl --env tools` from that; the last stage's model goes to `--out`, with
`training.json` (every stage, accuracy before and after each RL run, the tool evaluations) and the RL runs'
`rl.png` in the work folder. `--from CHECKPOINT` starts the tool stages from an existing model (the shipped
one: its own training.json records the addition stages and is carried over). Last (`--mtp-steps`), an MTP layer
is fitted to the final model's own greedy outputs (glm5_trainer.mtp), and speculation with it (k = 3) measured on
held-out problems: the drafter `glm5 worker` uses by default.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import random
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from glm5.errors import ConfigError
from glm5.parsing.reasoning import THINK_CLOSE, THINK_OPEN
from glm5.parsing.tools import ToolRegistry, tag_ids
from glm5.tokenizer.tokenizer import Tokenizer
from glm5_trainer.environment import (
    Outcome,
    Problem,
    builtin_problems,
    environment,
    evaluation_summary,
    prompt_ids,
    tool_problems,
)
from glm5_trainer.mtp import Trace, fit
from glm5_trainer.sft import train
from glm5_trainer.tool_family import evaluation_sets, held_out_problems
from glm5_trainer.tool_family import sample as sample_tool_problem
from glm5_trainer.tool_sft import finetune
from glm5_worker.config import EngineConfig, SpeculativeConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import FinishReason, SamplingParams
from glm5_worker.engine.speculative import SpecCounters
from glm5_worker.engine.structured import OutputFormat


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=6000, help="length of the supervised schedule (see --stop-at)")
    p.add_argument("--batch", type=int, default=48, help="supervised examples per step")
    p.add_argument("--lr", type=float, default=3e-3, help="supervised peak learning rate")
    p.add_argument("--max-operand", type=int, default=99, help="additions of two numbers up to this")
    p.add_argument("--held-out", type=int, default=500, help="problems kept out of training, for evaluation")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data order and the train/held-out split")
    p.add_argument("--stop-at", type=int, default=3500,
                   help="stop supervised training (and save) at this step of the --steps schedule")  # fmt: skip
    p.add_argument("--rl-steps", type=int, default=200, help="RL steps after supervised training (0: none)")
    p.add_argument("--rl-lr", type=float, default=1e-4, help="learning rate of the RL stage (cosine schedule)")
    p.add_argument("--rl-seed", type=int, default=0, help="RL problem order and sampling (the split is --seed's)")
    p.add_argument("--from", dest="base", type=Path,
                   help="start the tool stages from this checkpoint (e.g. the shipped model) instead of training "
                        "the addition stages")  # fmt: skip
    p.add_argument("--tool-steps", type=int, default=0,
                   help="after RL: supervised tool-use steps (tool traces, replayed additions; 0: none)")  # fmt: skip
    p.add_argument(
        "--tool-sft-args",
        type=json.loads,
        default={},
        help="JSON object of glm5_trainer.tool_sft.finetune arguments (e.g. '{\"drill_share\": 0.7}')",
    )
    p.add_argument("--tool-rl-steps", type=int, default=0,
                   help="after tool SFT (or on the --from checkpoint): `glm5 rl --env tools` steps")  # fmt: skip
    p.add_argument("--tool-rl-lr", type=float, default=1e-4, help="learning rate of the tool RL stage")
    p.add_argument("--mtp-steps", type=int, default=0,
                   help="last: fit a multi-token-prediction layer (speculative decoding's drafter) to the model's own "
                        "greedy outputs, the model frozen (glm5_trainer.mtp; 0: none)")  # fmt: skip
    p.add_argument("--mtp-args", type=json.loads, default={},
                   help="JSON object of glm5_trainer.mtp.fit arguments (e.g. '{\"depth\": 1}') and of the traces: "
                        "traces_per_set (default 400)")  # fmt: skip
    p.add_argument("--rl-arg", action="append", default=[],
                   help="a flag for every `glm5 rl` stage, after the stage's own (the last of a flag wins), e.g. "
                        "--rl-arg=--trainer-arg=--max-new-tokens=16 (repeatable)")  # fmt: skip
    p.add_argument("--work", type=Path, help="stage folders (default: OUT.work)")
    p.add_argument("--eval-only", action="store_true", help="only measure an existing checkpoint")


def evaluate(model_dir: Path, max_operand: int, held_out: int, seed: int, limit: int | None = None) -> float:
    """Exact-answer accuracy on the held-out pairs, greedy, served by our own engine."""
    _, test = builtin_problems(max_operand, held_out, seed)
    return float(play_offline(model_dir, "addition", test[:limit] if limit else test, max_new_tokens=40)["accuracy"])


def tool_call_format(tok: Tokenizer, p: Problem) -> OutputFormat | None:
    """What the router attaches to a chat request offering `p`'s tools under tool_choice auto
    (RouterConfig.tool_call_grammar): the lazy tool-call grammar, thinking before it free when it is on."""
    if not p.tools:
        return None
    ids = tag_ids(tok.token_id)
    if ids is None:
        raise ValueError("this tokenizer has no tool-call tokens")
    grammar = ToolRegistry.from_openai(list(p.tools)).call_grammar(None, ids, lazy=True)
    if not p.thinking:
        return OutputFormat("lark_grammar", grammar)
    return OutputFormat("lark_grammar", grammar, think_open=tok.token_id(THINK_OPEN),
                        think_close=tok.token_id(THINK_CLOSE))  # fmt: skip


def play_offline(model_dir: Path, env_name: str, problems: list[Problem], max_new_tokens: int = 48,
                 max_model_len: int = 1024, tool_grammar: bool = False, record: list[Trace] | None = None,
                 speculative: SpeculativeConfig | None = None) -> dict[str, Any]:  # fmt: skip
    """Plays every problem's episode (greedy) on our own engine in this process, all at once (the engine batches
    their turns), and summarises them: accuracy, and the tool calls (environment.evaluation_summary).
    `tool_grammar`: each turn held to the lazy tool-call grammar, as `glm5 serve` holds it (tool_call_format).
    `record`: every turn's context and generated tokens are appended to it. `speculative`: the engine drafts, and
    the summary gains its counters (`speculative`: accepted length, acceptance, acceptance by draft position)."""
    # eager: the same greedy tokens as compiled steps (tests/unit/worker/test_compiled_decode.py) without minutes
    # of compiling for a one-off evaluation
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=max_model_len, kv_cache_bytes=256 << 20,
                                 max_num_seqs=64, enforce_eager=True, speculative=speculative))  # fmt: skip
    env = environment(env_name)
    waiting: dict[str, tuple[asyncio.Future[tuple[list[int], bool]], list[int]]] = {}
    counter = itertools.count()

    def generator(fmt: OutputFormat | None) -> Callable[[list[int]], Awaitable[tuple[list[int], bool]]]:
        async def generate(context: list[int]) -> tuple[list[int], bool]:
            rid = f"t{next(counter)}"
            done: asyncio.Future[tuple[list[int], bool]] = asyncio.get_running_loop().create_future()
            waiting[rid] = (done, [])
            params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, output_format=fmt)
            engine.add_request(rid, None, context, params)
            return await done

        return generate

    async def main(make: Callable[[OutputFormat | None], Callable[[list[int]], Awaitable[tuple[list[int], bool]]]]
                   ) -> list[Outcome]:  # fmt: skip
        tok = engine.tokenizer
        formats = [tool_call_format(tok, p) if tool_grammar else None for p in problems]
        tasks = [asyncio.ensure_future(env.play(p, prompt_ids(tok, p), make(f), tok))
                 for p, f in zip(problems, formats, strict=True)]  # fmt: skip
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0)  # episodes whose turn ended submit their next one
            if not engine.has_work:
                continue
            for out in engine.step():
                done, ids = waiting[out.request_id]
                ids += out.token_ids
                if out.finished:
                    del waiting[out.request_id]
                    done.set_result((ids, out.finish_reason == FinishReason.LENGTH))
        return [t.result() for t in tasks]

    def generator_recording(fmt: OutputFormat | None) -> Callable[[list[int]], Awaitable[tuple[list[int], bool]]]:
        inner = generator(fmt)

        async def generate(context: list[int]) -> tuple[list[int], bool]:
            ids, truncated = await inner(context)
            if record is not None:
                record.append(Trace(list(context), list(ids)))
            return ids, truncated

        return generate

    summary = evaluation_summary(asyncio.run(main(generator_recording)))
    if (spec := engine.stats().speculative) is not None:
        summary["speculative"] = spec_summary(spec)
    return summary


def spec_summary(spec: SpecCounters) -> dict[str, Any]:
    """What a speculating evaluation reports (vLLM's spec_decode counters, summarised)."""
    by_position = [round(n / spec.steps, 4) if spec.steps else 0.0 for n in spec.by_position]
    return {"method": spec.method, "num_speculative_tokens": spec.k, "verify_steps": spec.steps,
            "accepted_length": round(spec.mean_accepted_length, 4), "acceptance": round(spec.acceptance_rate, 4),
            "acceptance_by_position": by_position}  # fmt: skip


def _rl(model: Path, out: Path, steps: int, lr: float, a: argparse.Namespace, env: str = "addition") -> dict[str, Any]:
    # tool episodes: a ~480-token prompt (the tools' JSON) and two turns of up to 48 tokens; smaller steps, as
    # each one trains ~20x the tokens of an addition step
    shape = (["--worker-arg=--max-model-len=256"] if env == "addition" else
             ["--worker-arg=--max-model-len=1024", "--trainer-arg=--max-new-tokens=48",
              "--trainer-arg=--groups-per-step=4", "--trainer-arg=--max-inflight-groups=8"])  # fmt: skip
    cmd = [sys.executable, "-m", "glm5_cli", "rl", "--model", str(model), "--workers", "2", "--out", str(out),
           "--env", env, "--steps", str(steps), "--learning-rate", str(lr), "--seed", str(a.rl_seed),
           f"--trainer-arg=--split-seed={a.seed}", "--worker-arg=--kv-cache-bytes=64MiB", *shape,
           f"--trainer-arg=--eval-size={a.held_out}", "--trainer-arg=--eval-every=50",
           "--trainer-arg=--lr-schedule=cosine", *a.rl_arg]  # fmt: skip
    if subprocess.run(cmd).returncode:
        raise ConfigError(f"the RL stage ({env}) failed (its log is above)")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def mtp_problem_sets(n: int, seed: int, held_out: bool) -> dict[str, list[Problem]]:
    """What the MTP layer is fitted on (training problems) or measured on (held-out ones): additions with
    thinking on and off, tool problems written in the ways tool SFT trained on (held-out: in ways it never saw)."""
    train, test = builtin_problems(held_out=500, seed=seed)
    rng = random.Random(f"mtp {seed} {held_out}")
    additions = rng.sample(test if held_out else train, min(n, len(test if held_out else train)))
    if held_out:
        tools = [p for ps in held_out_problems(per_bucket=max(1, n // 4), seed=seed).values() for p in ps][:n]
    else:
        tools = [sample_tool_problem(rng, thinking=rng.random() < 0.7) for _ in range(n)]
    off = [dataclasses.replace(p, thinking=False) for p in additions[: n // 2]]
    return {"addition": additions, "addition, thinking off": off, "tools": tools}


def _mtp_stage(a: argparse.Namespace, base: Path, work: Path, meta: dict[str, Any]) -> Path:
    """Fits an MTP layer to `base`'s greedy outputs (glm5_trainer.mtp), then measures speculation with it (k = 3)
    on held-out problems; returns the checkpoint with the layer."""
    args = dict(a.mtp_args)
    n = int(args.pop("traces_per_set", 400))
    traces: list[Trace] = []
    for name, problems in mtp_problem_sets(n, a.seed, held_out=False).items():
        env = "tools" if name == "tools" else "addition"
        play_offline(base, env, problems, max_new_tokens=64, max_model_len=2048, record=traces)
    print(f"mtp: {len(traces)} greedy traces of {base} collected", flush=True)
    try:
        record = fit(base, work / "mtp", traces, a.mtp_steps, seed=a.seed, **args)
    except TypeError as exc:
        raise ConfigError(f"--mtp-args: {exc}") from exc
    final = work / "mtp"
    spec = SpeculativeConfig("mtp", 3)
    record["evaluation"] = {}
    for name, problems in mtp_problem_sets(max(8, n // 2), a.seed, held_out=True).items():
        env = "tools" if name == "tools" else "addition"
        e = play_offline(final, env, problems, max_new_tokens=64, max_model_len=2048, speculative=spec)
        record["evaluation"][name] = e
    meta[_stage_key(meta, "mtp")] = record
    for name, e in record["evaluation"].items():
        sp = e["speculative"]
        acc = f"accuracy {e['accuracy']:.1%}, " if "accuracy" in e else ""
        print(f"held-out {name}: {acc}k=3 accepted length {sp['accepted_length']:.2f}, acceptance by position "
              f"{sp['acceptance_by_position']}", flush=True)  # fmt: skip
    return final


def _check(a: argparse.Namespace) -> None:
    if a.mtp_steps < 0 or not isinstance(a.mtp_args, dict):
        raise ConfigError("--mtp-steps >= 0 and --mtp-args a JSON object")
    if a.mtp_steps and not (a.rl_steps or a.base):
        raise ConfigError("--mtp-steps fits a drafter to a trained model: give the stages before it or --from")
    if min(a.rl_steps, a.tool_steps, a.tool_rl_steps) < 0 or (a.stop_at is not None and not 0 < a.stop_at <= a.steps):
        raise ConfigError("--rl-steps, --tool-steps, --tool-rl-steps >= 0 and 0 < --stop-at <= --steps")
    if a.tool_steps and not (a.rl_steps or a.base):
        raise ConfigError("--tool-steps trains on top of the RL stage (or --from a checkpoint): give --rl-steps")
    if a.base and not (a.tool_steps or a.tool_rl_steps or a.mtp_steps):
        raise ConfigError("--from starts the tool or MTP stages from a checkpoint: give --tool-steps, "
                          "--tool-rl-steps or --mtp-steps")  # fmt: skip
    if a.base and not (a.base / "config.json").is_file():
        raise ConfigError(f"--from {a.base}: not a checkpoint folder (no config.json)")
    if a.tool_rl_steps and not (a.tool_steps or a.base):
        raise ConfigError("--tool-rl-steps trains on top of the tool SFT stage: give --tool-steps (or --from)")
    if not isinstance(a.tool_sft_args, dict):
        raise ConfigError("--tool-sft-args must be a JSON object of glm5_trainer.tool_sft.finetune arguments")
    if (a.rl_steps or a.tool_steps) and (a.max_operand != 99 or a.held_out > 500):
        raise ConfigError("the RL stages train on the built-in split: --max-operand 99 and --held-out <= 500")


def _addition_stages(a: argparse.Namespace, work: Path, meta: dict[str, Any]) -> Path:
    """Supervised addition, then `glm5 rl` on it; returns the RL run's final checkpoint."""
    meta.update({"task": "addition", "max_operand": a.max_operand, "held_out": a.held_out, "seed": a.seed})
    meta["sft"] = train(work / "sft", a.steps, a.batch, a.lr, a.max_operand, a.held_out, a.seed, a.stop_at)
    summary = _rl(work / "sft", work / "rl", a.rl_steps, a.rl_lr, a)
    kept = ("accuracy_before", "accuracy_after", "train_seconds", "final_version")
    meta["rl"] = {"steps": a.rl_steps, "learning_rate": a.rl_lr, "lr_schedule": "cosine", "seed": a.rl_seed,
                  **{k: summary[k] for k in kept}}  # fmt: skip
    print(f"held-out accuracy: SFT {summary['accuracy_before']:.1%} -> RL {summary['accuracy_after']:.1%}; the RL "
          f"run (history, rl.png) in {work / 'rl'}")  # fmt: skip
    return Path(str(summary["final_checkpoint"]))


def _report(stage: str, e: dict[str, Any]) -> None:
    print(f"held-out tool problems after {stage}: accuracy {e['accuracy']:.1%}, tool-call validity "
          f"{e['tool_call_validity']}, unknown calls {e['unknown_tool_calls']}", flush=True)  # fmt: skip


def _stage_key(meta: dict[str, Any], name: str) -> str:
    """`name`, or name_2, name_3... when the checkpoint's record (`--from`) already holds such a stage."""
    return next(k for n in itertools.count(1) if (k := name + (f"_{n}" if n > 1 else "")) not in meta)


def _tool_stages(a: argparse.Namespace, base: Path, work: Path, meta: dict[str, Any]) -> Path:
    """Supervised tool use on top of `base` (traces, drills, replayed additions: glm5_trainer.tool_sft), then
    `glm5 rl --env tools` from it (either stage may be skipped); returns the last stage's checkpoint. A second
    stage on a checkpoint that had one (`--from`) is recorded beside it, as tools_sft_2, tools_rl_2 and so on."""
    final = base
    if a.tool_steps:
        try:
            tools = finetune(base, work / "tools", a.tool_steps, held_out=a.held_out, seed=a.seed, **a.tool_sft_args)
        except TypeError as exc:
            raise ConfigError(f"--tool-sft-args: {exc}") from exc
        final = work / "tools"
        _, held_out = tool_problems(held_out=a.held_out, seed=a.seed)
        e = tools["evaluation"] = play_offline(final, "tools", held_out)
        if tools["variant_share"]:  # and on tools written in ways it never saw (glm5_trainer.tool_family)
            tools["evaluation_variants"] = {
                name: play_offline(final, "tools", problems, max_new_tokens=64, max_model_len=8192)
                for name, problems in evaluation_sets().items()
            }
        meta[_stage_key(meta, "tools_sft")] = tools
        _report("tool SFT", e)
        for name, v in tools.get("evaluation_variants", {}).items():
            _report(f"tool SFT ({name})", v)
    if not a.tool_rl_steps:
        return final
    tool_rl = _rl(final, work / "rl-tools", a.tool_rl_steps, a.tool_rl_lr, a, env="tools")
    kept = ("evaluation_before", "evaluation_after", "train_seconds", "final_version")
    meta[_stage_key(meta, "tools_rl")] = {"steps": a.tool_rl_steps, "learning_rate": a.tool_rl_lr,
                                          "lr_schedule": "cosine", "seed": a.rl_seed,
                                          **{k: tool_rl[k] for k in kept}}  # fmt: skip
    if e := tool_rl["evaluation_after"]:
        _report("tool RL", e)
    return Path(str(tool_rl["final_checkpoint"]))


def run(a: argparse.Namespace) -> None:
    if a.eval_only:
        print(f"held-out accuracy: {evaluate(a.out, a.max_operand, a.held_out, a.seed):.1%}")
        return
    _check(a)
    if not (a.rl_steps or a.base):
        print(json.dumps(train(a.out, a.steps, a.batch, a.lr, a.max_operand, a.held_out, a.seed, a.stop_at)))
        print(f"held-out accuracy: {evaluate(a.out, a.max_operand, a.held_out, a.seed):.1%}")
        return
    work = a.work or a.out.with_name(a.out.name + ".work")
    meta: dict[str, Any] = {}
    if a.base:
        # the addition stages are the base's own (its training.json, kept); the tool stages start from it
        record = a.base / "training.json"
        meta.update(json.loads(record.read_text()) if record.is_file() else {})
        meta.setdefault("tools_from", str(a.base))  # where the first tool stage started
        final = a.base
    else:
        final = _addition_stages(a, work, meta)
    if a.tool_steps or (a.tool_rl_steps and a.base):
        final = _tool_stages(a, final, work, meta)
    if a.mtp_steps:
        final = _mtp_stage(a, final, work, meta)
    a.out.mkdir(parents=True, exist_ok=True)
    for f in final.iterdir():
        if f.is_file() and f.name not in ("version.json", "training.json"):
            shutil.copyfile(f, a.out / f.name)  # not the 0600 mode transformers writes
    (a.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"the model is in {a.out}, its stages in {work}")
