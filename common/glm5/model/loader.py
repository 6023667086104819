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
from tqdm import tqdm

from glm5.errors import CheckpointError
from glm5.model.config import ModelConfig, RopeConfig
from glm5.model.model import DecoderLayer, GlmMoeDsaForCausalLM
from glm5.model.moe import MoE
from glm5.parallel import SINGLE, TensorParallel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Split by rows (output features) / columns (input features) under tensor parallelism; all else is replicated.
_ROWS = re.compile(
    r"^(model\.embed_tokens|lm_head|model\.layers\.\d+\.(self_attn\.(q_b_proj|kv_b_proj)"
    r"|mlp\.(shared_experts\.)?(gate_proj|up_proj)))\.weight$"
)
_COLUMNS = re.compile(r"^model\.layers\.\d+\.(self_attn\.o_proj|mlp\.(shared_experts\.)?down_proj)\.weight$")
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
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "unknown")
        raise CheckpointError(f"quantized checkpoints ({method}) are not supported yet; use a bf16 checkpoint")
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
                full, index = _split(target, 0 if _ROWS.match(name) else 1, tp)
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
    layer = model.model.layers[int(stacked.split(".")[2])]
    assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp, MoE)
    return layer.mlp.experts.num_experts


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers this process holds (a rank's shard under tensor parallelism)."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}  # tied weights count once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _load_expert(
    params: dict[str, torch.Tensor],
    expert_parts: dict[str, set[tuple[int, str]]],
    match: re.Match[str],
    lazy: _Lazy,
    name: str,
    config: ModelConfig,
    tp: TensorParallel,
) -> None:
    """Reads this rank's part of one expert's projection (nothing if another rank holds the expert)."""
    layer, e, which = int(match.group(1)), int(match.group(2)), match.group(3)
    prefix = f"model.layers.{layer}.mlp.experts"
    gate_up, down = params.get(f"{prefix}.gate_up_proj"), params.get(f"{prefix}.down_proj")
    if gate_up is None or down is None or e >= config.n_routed_experts:
        raise CheckpointError(f"tensor {name} does not fit the config (no such MoE layer or expert)")
    first, inter = 0, gate_up.shape[1] // 2  # this rank's intermediate size
    if tp.expert_parallel:
        first, stop = tp.span(config.n_routed_experts)
        if not first <= e < stop:
            return  # another rank's expert
    if which == "down":
        target = down[e - first]
    else:
        rows = slice(0, inter) if which == "gate" else slice(inter, 2 * inter)
        target = gate_up[e - first, rows]
    full, index = tuple(target.shape), tuple[slice, ...]()
    if tp.size > 1 and not tp.expert_parallel:
        full, index = _split(target, 1 if which == "down" else 0, tp)
    if lazy.shape != full:
        raise CheckpointError(f"tensor {name} has shape {lazy.shape} in the checkpoint but the config needs {full}")
    target.copy_(lazy.read(index))
    expert_parts.setdefault(f"{prefix}.gate_up_proj", set()).add((e, which))


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
