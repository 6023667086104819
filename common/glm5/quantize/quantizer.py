"""Writes a quantized copy of a float checkpoint, one tensor at a time (peak memory: one tensor and one shard).

Output names and `quantization_config` are the ones the loader (glm5.model.quant), vLLM and SGLang read:
- fp8-block: GLM-5-FP8's format (`quant_method: fp8`, float8 `weight` + float32 `weight_scale_inv`);
- w4a16: compressed-tensors `pack-quantized` (`weight_packed`, `weight_scale`, `weight_shape`);
- w4a16-fp8-mix: compressed-tensors `mixed-precision`: INT4 groups as above, FP8 groups `float-quantized`
  (float8 `weight` + `weight_scale`).
Every module left unquantized is listed (`modules_to_not_convert` / `ignore`), so a reader that targets all
linear layers skips exactly those.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from glm5.errors import CheckpointError, ConfigError
from glm5.model.config import ModelConfig
from glm5.model.loader import checkpoint_files, iter_tensors
from glm5.model.quant import pack_int4
from glm5.quantize.methods import fp8_block, int4_gptq, int4_rtn
from glm5.quantize.recipe import Recipe

# a safetensors file's header and alignment on top of its tensor bytes
_HEADER_ALLOWANCE = 1 << 20
_QUANTIZABLE = (
    r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.(wq_b|wk|weights_proj))",
    r"mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)",
    r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)",
)


@dataclass
class Summary:
    """What was written: bytes per stored format, modules per format, the shards."""

    bytes_by_format: dict[str, int] = field(default_factory=dict)
    modules: dict[str, int] = field(default_factory=dict)
    float_bytes_quantized: int = 0  # the quantized layers' bytes before quantization
    stored_bytes_quantized: int = 0  # ... and after (values + scales)
    shards: list[tuple[str, int]] = field(default_factory=list)

    def add(self, fmt: str, nbytes: int) -> None:
        self.bytes_by_format[fmt] = self.bytes_by_format.get(fmt, 0) + nbytes

    def table(self) -> str:
        total = sum(self.bytes_by_format.values())
        lines = [f"{'format':<26}{'bytes':>16}{'share':>8}"]
        for fmt, n in sorted(self.bytes_by_format.items(), key=lambda kv: -kv[1]):
            lines.append(f"{fmt:<26}{n:>16,}{n / total:>8.1%}")
        lines.append(f"{'total':<26}{total:>16,}")
        if self.float_bytes_quantized:
            ratio = self.stored_bytes_quantized / self.float_bytes_quantized
            counts = ", ".join(f"{v} {k}" for k, v in self.modules.items())
            lines.append(
                f"quantized layers: {sum(self.modules.values())} ({counts}), {self.stored_bytes_quantized:,} bytes "
                f"= {ratio:.3f}x their {self.float_bytes_quantized:,} before"
            )
        lines.append(f"{len(self.shards)} shard(s), largest {max(n for _, n in self.shards):,} bytes")
        return "\n".join(lines)


class ShardWriter:
    """Safetensors shards of at most `max_bytes` each (a tensor larger than that gets a shard of its own, and
    is an error), then model.safetensors.index.json naming every tensor's shard."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        if max_bytes <= _HEADER_ALLOWANCE:
            raise ConfigError(f"--max-shard-size must be more than {_HEADER_ALLOWANCE:,} bytes, got {max_bytes:,}")
        self.out, self.limit = out, max_bytes - _HEADER_ALLOWANCE
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str], int]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.limit:
            raise ConfigError(f"tensor {name} is {nbytes:,} bytes, more than --max-shard-size allows")
        if self.pending and self.pending_bytes + nbytes > self.limit:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes

    def _flush(self) -> None:
        path = self.out / f".shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending), self.pending_bytes))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[tuple[str, int]]:
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        weight_map: dict[str, str] = {}
        shards = []
        for i, (tmp, names, _) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            tmp.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
            shards.append((final, (self.out / final).stat().st_size))
        if n > 1:
            total = sum(nbytes for _, _, nbytes in self.files)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return shards


def quantizable(name: str) -> bool:
    """Whether `name` (a module) is a linear layer the loader can hold quantized."""
    return any(re.fullmatch(rf"model\.layers\.\d+\.{p}", name) for p in _QUANTIZABLE)


def plan(recipe: Recipe, shapes: dict[str, tuple[int, ...]], config: ModelConfig) -> dict[str, str]:
    """module -> 'int4' | 'fp8' for every linear weight the recipe quantizes; errors for what cannot be."""
    out: dict[str, str] = {}
    for name, shape in shapes.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name.removesuffix(".weight")
        # multi-token-prediction layers' blocks are quantized like the decoder layers' (GLM-5-FP8 stores them so;
        # the loader reads them by the same names); their eh_proj and norms stay as stored
        fmt = recipe.format_of(module)
        if fmt is None:
            continue
        if not quantizable(module):
            if any(fnmatch.fnmatchcase(module, g) for g in recipe.include if "*" not in g):
                raise ConfigError(f"recipe names {module}, which this tool cannot quantize (not a linear layer)")
            continue
        if fmt == "int4" and shape[1] % recipe.group_size:
            raise ConfigError(
                f"{module} has {shape[1]} input columns, not a multiple of group_size {recipe.group_size}; set a "
                "smaller group_size (--group-size) or exclude it in the recipe"
            )
        out[module] = fmt
    if not out:
        raise ConfigError("the recipe's include/exclude globs match no linear layer of this checkpoint")
    return out


Hessians = dict[str, torch.Tensor]


def quantize_checkpoint(
    src: Path,
    out: Path,
    recipe: Recipe,
    max_shard_bytes: int = 2 << 30,
    hessians: Hessians | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> Summary:
    """Quantizes the checkpoint at `src` into `out` (created; must not hold a checkpoint already)."""
    config = ModelConfig.from_file(src)
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config"):
        raise CheckpointError(f"{src} is already quantized ({raw['quantization_config'].get('quant_method')})")
    if out.resolve() == src.resolve():
        raise ConfigError("--out must differ from --model")
    if out.exists() and any(out.glob("*.safetensors")):
        raise ConfigError(f"{out} already holds a checkpoint; choose an empty directory")
    files = checkpoint_files(src)
    shapes = {name: lazy.shape for name, lazy in iter_tensors(files)}
    targets = plan(recipe, shapes, config)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".shard-*.safetensors"):
        stale.unlink()
    writer = ShardWriter(out, max_shard_bytes)
    summary = Summary()
    ct = recipe.scheme != "fp8-block"  # compressed-tensors names the FP8 scale weight_scale
    total = sum(f.stat().st_size for f in files)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"quantizing ({recipe.scheme})", disable=not progress
    ) as bar:
        for name, lazy in iter_tensors(files):
            bar.update(lazy.nbytes)
            module = name.removesuffix(".weight")
            fmt = targets.get(module) if name.endswith(".weight") else None
            tensor = lazy.read()
            if fmt is None:
                writer.add(name, tensor)
                summary.add(str(tensor.dtype).removeprefix("torch."), _nbytes(tensor))
                continue
            summary.float_bytes_quantized += _nbytes(tensor)
            summary.modules[fmt] = summary.modules.get(fmt, 0) + 1
            written = _quantize(module, tensor, fmt, recipe, hessians, ct)
            for key, value in written.items():
                writer.add(key, value)
                kind = "int4 (packed int32)" if key.endswith("_packed") else str(value.dtype).removeprefix("torch.")
                if "_scale" in key or key.endswith("_shape"):
                    kind = f"{fmt} scales"
                summary.add(kind, _nbytes(value))
                summary.stored_bytes_quantized += _nbytes(value)
    summary.shards = writer.close()
    linear = [n.removesuffix(".weight") for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2]
    unquantized = sorted(m for m in linear if m not in targets and not m.endswith("embed_tokens"))
    raw["quantization_config"] = quantization_config(recipe, targets, unquantized)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for extra in src.iterdir():  # tokenizer, generation config, chat template, ...
        if (
            extra.is_file()
            and extra.suffix != ".safetensors"
            and extra.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(extra, out / extra.name)
    log(summary.table())
    return summary


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _quantize(
    module: str, w: torch.Tensor, fmt: str, recipe: Recipe, hessians: Hessians | None, ct: bool
) -> dict[str, torch.Tensor]:
    if fmt == "fp8":
        q, scale = fp8_block(w, recipe.block_size)
        return {f"{module}.weight": q, f"{module}.weight_scale" if ct else f"{module}.weight_scale_inv": scale}
    h = hessians.get(module) if hessians else None
    if h is not None:
        cal = recipe.calibration
        q, scale = int4_gptq(w, h, recipe.group_size, cal.damp, cal.block)
    else:
        q, scale = int4_rtn(w, recipe.group_size)
    # compressed-tensors keeps scales in the model's float dtype
    scale_dtype = w.dtype if w.dtype.is_floating_point else torch.float32
    return {
        f"{module}.weight_packed": pack_int4(q),
        f"{module}.weight_scale": scale.to(scale_dtype),
        f"{module}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }


def _int4_args(recipe: Recipe) -> dict[str, Any]:
    return {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": recipe.group_size,
            "dynamic": False, "actorder": None, "observer": "minmax"}  # fmt: skip


def _fp8_group(recipe: Recipe, targets: list[str]) -> dict[str, Any]:
    br, bc = recipe.block_size
    return {
        "targets": targets,
        "weights": {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "block",
            "block_structure": [br, bc],
            "dynamic": False,
            "observer": "minmax",
        },
        "input_activations": {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "group",
            "group_size": bc,
            "dynamic": True,
            "observer": None,
        },
        "output_activations": None,
        "format": "float-quantized",
    }


def quantization_config(recipe: Recipe, targets: dict[str, str], unquantized: list[str]) -> dict[str, Any]:
    if recipe.scheme == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(recipe.block_size), "modules_to_not_convert": unquantized}  # fmt: skip
    int4_group = {"targets": ["Linear"], "weights": _int4_args(recipe), "input_activations": None,
                  "output_activations": None, "format": "pack-quantized"}  # fmt: skip
    if recipe.scheme == "w4a16":
        groups = {"group_0": int4_group}
        fmt = "pack-quantized"
    else:
        # first match wins in our loader; vLLM prefers a regex target over a class name, so the two agree
        int4_group["targets"] = [f"re:{fnmatch.translate(g)}" for g in recipe.int4]
        groups = {"group_0": int4_group, "group_1": _fp8_group(recipe, ["Linear"])}
        fmt = "mixed-precision"
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": groups, "ignore": unquantized, "kv_cache_scheme": None}  # fmt: skip


def hessian_names(prefix: str, expert: int, which: str) -> list[str]:
    """The modules whose GPTQ Hessian an expert's gate_up or down input feeds."""
    base = f"{prefix}.{expert}"
    return [f"{base}.gate_proj", f"{base}.up_proj"] if which == "gate_up" else [f"{base}.down_proj"]
