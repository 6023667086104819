"""Loading and saving HuggingFace-format GlmMoeDsa checkpoints (safetensors, single file or sharded).

Tensors are read lazily one at a time into a model built on the meta device, so peak memory is the model
plus one tensor. Routed experts are stored per expert on disk (mlp.experts.{e}.{gate,up,down}_proj.weight)
and stacked in memory. Multi-token-prediction layers (index >= num_hidden_layers) are skipped.

Under tensor parallelism (glm5.parallel) a rank reads only its slices (safetensors' get_slice): a split
tensor's rows or columns, its own experts, never the whole checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from glm5.errors import CheckpointError
from glm5.model.config import ModelConfig, RopeConfig
from glm5.model.model import DecoderLayer, GlmMoeDsaForCausalLM
from glm5.model.moe import Experts, MoE
from glm5.model.quant import SCALE_SUFFIX, Fp8Linear, QuantConfig
from glm5.parallel import SINGLE, TensorParallel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight(_scale_inv)?$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Split by rows (output features) / columns (input features) under tensor parallelism; all else is replicated.
_ROWS = re.compile(
    r"^(model\.embed_tokens|lm_head|model\.layers\.\d+\.(self_attn\.(q_b_proj|kv_b_proj)"
    r"|mlp\.(shared_experts\.)?(gate_proj|up_proj)))\.weight(_scale_inv)?$"
)
_COLUMNS = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.o_proj|mlp\.(shared_experts\.)?down_proj)\.weight(_scale_inv)?$"
)
_ROW_PARALLEL_BIAS = re.compile(r"^model\.layers\.\d+\.self_attn\.o_proj\.bias$")
PROGRESS_MIN_BYTES = 256 << 20
_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}") from None


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in a stable order."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")
    return found


class _NoBar(contextlib.nullcontext[None]):
    def update(self, n: int) -> None:
        pass


class _Lazy:
    """One checkpoint tensor, not read yet: `read(index)` reads only the indexed part."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    @property
    def dtype(self) -> str:
        return str(self._slice.get_dtype())

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES.get(self._slice.get_dtype(), 2)

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor:
        tensor: torch.Tensor = self._slice[index] if index else self._slice[:]
        return tensor


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, _Lazy]]:
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, _Lazy(f, name)


def _split(target: torch.Tensor, dim: int, tp: TensorParallel) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """The full shape a rank's split tensor comes from, and the index of its part."""
    local = target.shape[dim]
    full = list(target.shape)
    full[dim] = local * tp.size
    index = [slice(None)] * target.dim()
    index[dim] = slice(tp.rank * local, (tp.rank + 1) * local)
    return tuple(full), tuple(index)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
    rope: RopeConfig | None = None,
    tp: TensorParallel = SINGLE,
) -> GlmMoeDsaForCausalLM:
    """Builds the model of the checkpoint at `path` (this rank's shard under `tp`); `rope` replaces the
    checkpoint's RoPE parameters."""
    path, device = Path(path), torch.device(device)
    config = ModelConfig.from_file(path)
    if rope is not None:
        config.rope = rope
    raw = json.loads((path / "config.json").read_text())
    quant = QuantConfig.from_config(raw.get("quantization_config"))
    files = checkpoint_files(path)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(config, tp)
    model = model.to(dtype)
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        indexer = layer.self_attn.indexer
        if indexer is not None:
            indexer.weights_proj.float()
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate.e_score_correction_bias = layer.mlp.gate.e_score_correction_bias.float()
    _use_stored_formats(model, _stored_dtypes(files), quant, dtype)
    model = model.to_empty(device=device)
    params: dict[str, torch.Tensor] = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    pending = set(params)
    expert_parts: dict[str, set[tuple[int, str]]] = {}
    skipped_mtp = 0
    unexpected: list[str] = []
    total = sum(f.stat().st_size for f in files)
    show = progress if progress is not None else total >= PROGRESS_MIN_BYTES
    desc = "loading weights" if tp.size == 1 else f"loading weights (rank {tp.rank})"
    # built only when shown: any tqdm creates a multiprocessing lock, which a rank process that ends with
    # os._exit leaves behind for the resource tracker to warn about
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc) if show else _NoBar()
    with torch.no_grad(), bar:
        for name, lazy in _iter_tensors(files):
            bar.update(lazy.nbytes)  # scanned, whether this rank reads it all, a part or nothing
            layer_match = _LAYER.match(name)
            if layer_match and int(layer_match.group(1)) >= config.num_hidden_layers:
                skipped_mtp += 1
                continue
            expert = _EXPERT.match(name)
            if expert:
                _load_expert(params, expert_parts, expert, lazy, name, config, tp)
                continue
            target = params.get(name)
            if target is None:
                unexpected.append(name)
                continue
            full, index = tuple(target.shape), tuple[slice, ...]()
            if tp.size > 1 and (_ROWS.match(name) or _COLUMNS.match(name)):
                dim = 0 if _ROWS.match(name) else 1
                if name.endswith(SCALE_SUFFIX):
                    weight = params[name.removesuffix(SCALE_SUFFIX)]
                    full, index = _split_scale(name, target, weight.shape[dim], dim, _block_of(model, name), tp)
                else:
                    full, index = _split(target, dim, tp)
            if lazy.shape != full:
                raise CheckpointError(
                    f"tensor {name} has shape {lazy.shape} in the checkpoint but the config needs {full}"
                )
            if tp.rank > 0 and _ROW_PARALLEL_BIAS.match(name):
                target.zero_()  # the ranks' partial outputs are summed: the bias is added once, by rank 0
            else:
                target.copy_(lazy.read(index))
            pending.discard(name)
    for stacked, parts in expert_parts.items():
        if len(parts) == _local_experts(model, stacked) * 3:
            pending.discard(stacked.replace(".gate_up_proj", ".down_proj"))
            pending.discard(stacked)
    if "lm_head.weight" in pending and config.tie_word_embeddings:
        model.tie_weights()
        pending.discard("lm_head.weight")
    if pending:
        listed = ", ".join(sorted(pending)[:8])
        raise CheckpointError(f"checkpoint {path} is missing {len(pending)} tensors: {listed}")
    if skipped_mtp:
        log.info("ignored %d tensors of multi-token-prediction layers (not used for serving)", skipped_mtp)
    if unexpected:
        log.warning("ignored %d unknown tensors, e.g. %s", len(unexpected), unexpected[0])
    return model.eval()


def _local_experts(model: GlmMoeDsaForCausalLM, stacked: str) -> int:
    """Experts this rank holds in the MoE layer that `stacked` (...mlp.experts.gate_up_proj) belongs to."""
    return _experts(model, int(stacked.split(".")[2])).num_experts


def _experts(model: GlmMoeDsaForCausalLM, layer_index: int) -> Experts:
    layer = model.model.layers[layer_index]
    assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp, MoE)
    return layer.mlp.experts


def _stored_dtypes(files: list[Path]) -> dict[str, str]:
    """Every tensor's stored dtype (safetensors' names: F8_E4M3, BF16, ...), from the headers only."""
    out: dict[str, str] = {}
    for name, lazy in _iter_tensors(files):
        out[name] = lazy.dtype
    return out


def _use_stored_formats(
    model: GlmMoeDsaForCausalLM, stored: dict[str, str], quant: QuantConfig | None, dtype: torch.dtype
) -> None:
    """Swaps in block-FP8 layers (on the meta device) where the checkpoint stores a float8 weight: what is
    quantized is what the file holds, whatever `modules_to_not_convert` lists."""
    fp8 = [name for name, d in stored.items() if d == "F8_E4M3"]
    if not fp8:
        return
    if quant is None:
        raise CheckpointError(f"tensor {fp8[0]} is float8 but config.json has no quantization_config")
    for name in fp8:
        if name.endswith(".weight") and name + SCALE_SUFFIX not in stored:
            raise CheckpointError(f"tensor {name} is float8 but {name}{SCALE_SUFFIX} is missing from the checkpoint")
    for mod_name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and stored.get(f"{mod_name}.weight") == "F8_E4M3":
            parent, _, attr = mod_name.rpartition(".")
            with torch.device("meta"):
                fp8_linear = Fp8Linear(
                    module.in_features, module.out_features, module.bias is not None, quant.block, dtype
                )
            setattr(model.get_submodule(parent), attr, fp8_linear)
        elif isinstance(module, Experts):
            first = f"{mod_name}.{module.first_expert}.gate_proj.weight"
            if stored.get(first) == "F8_E4M3":
                module.to_fp8(quant.block)


def _block_of(model: GlmMoeDsaForCausalLM, scale_name: str) -> tuple[int, int]:
    module = model.get_submodule(scale_name.removesuffix(".weight_scale_inv"))
    assert isinstance(module, Fp8Linear)
    return module.block


def _split_scale(
    name: str, target: torch.Tensor, weight_local: int, dim: int, block: tuple[int, int], tp: TensorParallel
) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """The rows or columns of block scales that cover this rank's part of a split FP8 weight; an error if the
    split cuts a quantization block (the rank's part would need scales of values it does not hold)."""
    size = block[dim]
    start, stop, total = tp.rank * weight_local, (tp.rank + 1) * weight_local, weight_local * tp.size
    if start % size or (stop % size and stop != total):
        what = "rows" if dim == 0 else "columns"
        raise CheckpointError(
            f"tensor {name}: rank {tp.rank}'s {what} [{start}, {stop}) of {total} cut its quantization blocks of "
            f"{size}; choose a tensor parallel size that splits the {what} into whole blocks"
        )
    full = list(target.shape)
    full[dim] = math.ceil(total / size)
    index = [slice(None)] * target.dim()
    index[dim] = slice(start // size, math.ceil(stop / size))
    return tuple(full), tuple(index)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers this process holds (a rank's shard under tensor parallelism)."""
    return sum(weight_bytes_by_dtype(model).values())


def weight_bytes_by_dtype(model: torch.nn.Module) -> dict[str, int]:
    """The same bytes by storage format (float8_e4m3fn, bfloat16, float32, ...)."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}  # tied weights count once
    out: dict[str, int] = {}
    for t in tensors.values():
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def weight_placement(model: torch.nn.Module) -> dict[str, int]:
    """Weight bytes by the memory holding them: {"device": ..., "host": ...} (a CPU model is all host)."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    out = {"device": 0, "host": 0}
    for t in tensors.values():
        out["host" if t.device.type == "cpu" else "device"] += t.numel() * t.element_size()
    return out


def _load_expert(
    params: dict[str, torch.Tensor],
    expert_parts: dict[str, set[tuple[int, str]]],
    match: re.Match[str],
    lazy: _Lazy,
    name: str,
    config: ModelConfig,
    tp: TensorParallel,
) -> None:
    """Reads this rank's part of one expert's projection or its FP8 scales (nothing if another rank holds
    the expert)."""
    layer, e, which, scale = int(match.group(1)), int(match.group(2)), match.group(3), bool(match.group(4))
    prefix = f"model.layers.{layer}.mlp.experts"
    suffix = SCALE_SUFFIX if scale else ""
    gate_up, down = params.get(f"{prefix}.gate_up_proj{suffix}"), params.get(f"{prefix}.down_proj{suffix}")
    if gate_up is None or down is None or e >= config.n_routed_experts:
        what = "FP8 scales of a float" if scale and gate_up is None else "no such MoE layer or"
        raise CheckpointError(f"tensor {name} does not fit the config ({what} expert)")
    first = 0
    if tp.expert_parallel:
        first, stop = tp.span(config.n_routed_experts)
        if not first <= e < stop:
            return  # another rank's expert
    if which == "down":
        target = down[e - first]
    else:
        half = gate_up.shape[1] // 2
        target = gate_up[e - first, slice(0, half) if which == "gate" else slice(half, 2 * half)]
    full, index = tuple(target.shape), tuple[slice, ...]()
    if tp.size > 1 and not tp.expert_parallel:
        dim = 1 if which == "down" else 0
        if scale:
            weight = params[f"{prefix}.{'down' if which == 'down' else 'gate_up'}_proj"]
            local = weight.shape[2] if which == "down" else weight.shape[1] // 2
            block = _experts_block(params, prefix)
            full, index = _split_scale(name, target, local, dim, block, tp)
        else:
            full, index = _split(target, dim, tp)
    if lazy.shape != full:
        raise CheckpointError(f"tensor {name} has shape {lazy.shape} in the checkpoint but the config needs {full}")
    target.copy_(lazy.read(index))
    expert_parts.setdefault(f"{prefix}.gate_up_proj{suffix}", set()).add((e, which))


def _experts_block(params: dict[str, torch.Tensor], prefix: str) -> tuple[int, int]:
    """The FP8 block of a layer's experts, from its weight and scale shapes (the module is not at hand)."""
    w, s = params[f"{prefix}.down_proj"], params[f"{prefix}.down_proj_scale_inv"]
    return math.ceil(w.shape[1] / s.shape[1]), math.ceil(w.shape[2] / s.shape[2])


def checkpoint_state_dict(model: GlmMoeDsaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under their on-disk names (experts split per expert), contiguous, on CPU."""
    out: dict[str, torch.Tensor] = {}
    inter = model.config.moe_intermediate_size
    for name, tensor in model.state_dict().items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, inter:]
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def save_checkpoint(model: GlmMoeDsaForCausalLM, path: str | Path, max_shard_bytes: int = 2 << 30) -> None:
    """Writes config.json and safetensors shards (with an index when there is more than one)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    tensors = checkpoint_state_dict(model)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for stale in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
