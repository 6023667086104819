"""`glm5 quantize`: a float checkpoint to block FP8, W4A16 or INT4 experts + FP8 (glm5.quantize).

INT4 is calibrated with GPTQ when --calibration gives prompts: our engine runs them through the float model
and every INT4 layer's inputs are summed into its Hessian (routed experts see only the tokens routed to them);
without prompts, or with `calibration: {method: rtn}` in the recipe, it rounds to nearest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from glm5.errors import ConfigError
from glm5.model.moe import Experts
from glm5.quantize.quantizer import Hessians, hessian_names, quantize_checkpoint
from glm5.quantize.recipe import SCHEMES, Recipe, load_recipe
from glm5.units import parse_bytes
from glm5_worker.config import EngineConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams

MAX_CALIBRATION_LINE = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="float checkpoint directory (safetensors)")
    p.add_argument("--out", type=Path, required=True, help="directory to write the quantized checkpoint to")
    p.add_argument("--scheme", choices=SCHEMES, help="the shipped default recipe of this scheme (or give --recipe)")
    p.add_argument("--recipe", type=Path, help="YAML recipe: scheme, include/exclude globs, group size, calibration")
    p.add_argument(
        "--calibration", type=Path, help="JSONL of prompts for GPTQ: {prompt|text: str} or {messages: [...]}"
    )
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors file written (default 2GB)")
    p.add_argument("--group-size", type=int, help="INT4 columns per scale (overrides the recipe)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(a: argparse.Namespace) -> None:
    if a.scheme is None and a.recipe is None:
        raise ConfigError("give --scheme (fp8-block, w4a16, w4a16-fp8-mix) or --recipe")
    recipe = load_recipe(a.scheme, a.recipe).with_group_size(a.group_size)
    max_bytes = parse_bytes(a.max_shard_size)
    if max_bytes is None:
        raise ConfigError("--max-shard-size must be a size such as 2GB")
    hessians = None
    if recipe.scheme != "fp8-block" and a.calibration is not None and recipe.calibration.method == "gptq":
        texts = read_calibration(a.calibration, recipe.calibration.max_samples)
        hessians = collect_hessians(a.model, texts, recipe)
        print(f"calibrated {len(hessians)} INT4 layers on {len(texts)} prompts (GPTQ)", file=sys.stderr)
    elif recipe.scheme != "fp8-block":
        print("no --calibration: INT4 by round-to-nearest", file=sys.stderr)
    quantize_checkpoint(a.model, a.out, recipe, max_bytes, hessians, progress=not a.no_progress)
    print(f"wrote {a.out}")


def read_calibration(path: Path, limit: int) -> list[str | list[dict[str, str]]]:
    """Prompts (strings) or conversations (message lists) from a JSONL file, at most `limit`."""
    out: list[str | list[dict[str, str]]] = []
    try:
        handle = path.open()
    except OSError as exc:
        raise ConfigError(f"cannot read calibration file {path}: {exc.strerror}") from exc
    with handle:
        for number, line in enumerate(handle, 1):
            if len(out) >= limit:
                break
            if not line.strip():
                continue
            if len(line) > MAX_CALIBRATION_LINE:
                raise ConfigError(f"{path}:{number}: line longer than {MAX_CALIBRATION_LINE:,} characters")
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number}: not JSON: {exc.msg}") from exc
            text = item.get("prompt", item.get("text")) if isinstance(item, dict) else None
            messages = item.get("messages") if isinstance(item, dict) else None
            if isinstance(text, str) and text:
                out.append(text)
            elif (
                isinstance(messages, list)
                and messages
                and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                out.append(messages)
            else:
                raise ConfigError(
                    f'{path}:{number}: expected {{"prompt": str}}, {{"text": str}} or {{"messages": [...]}}'
                )
    if not out:
        raise ConfigError(f"calibration file {path} holds no prompts")
    return out


def collect_hessians(model_dir: Path, texts: list[str | list[dict[str, str]]], recipe: Recipe) -> Hessians:
    """sum(x^T x) of every INT4 layer's inputs over the calibration prompts, run by our engine in float32."""
    max_tokens = recipe.calibration.max_tokens
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=max_tokens + 8,
                                 kv_cache_bytes=256 << 20, max_num_seqs=16))  # fmt: skip
    hessians: Hessians = {}

    def add(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        h = hessians.get(name)
        hessians[name] = x.t() @ x if h is None else h + x.t() @ x

    handles = []
    for name, module in engine.model.named_modules():
        if isinstance(module, torch.nn.Linear) and recipe.format_of(name) == "int4":
            handles.append(module.register_forward_pre_hook(lambda _m, args, n=name: add(n, args[0])))
        elif isinstance(module, Experts) and recipe.format_of(f"{name}.{module.first_expert}.gate_proj") == "int4":

            def observe(expert: int, which: str, x: torch.Tensor, prefix: str = name) -> None:
                for target in hessian_names(prefix, expert, which):
                    add(target, x)

            module.observer = observe
    try:
        for i, item in enumerate(texts):
            text = item if isinstance(item, str) else engine.tokenizer.apply_chat_template(item)
            ids = engine.tokenizer.encode(text)[:max_tokens]
            engine.add_request(f"c{i}", None, ids, SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
        while engine.has_work:
            engine.step()
    finally:
        for handle in handles:
            handle.remove()
        for module in engine.model.modules():
            if isinstance(module, Experts):
                module.observer = None
    return {name: h.float() for name, h in hessians.items()}
