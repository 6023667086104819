"""Loading and saving HuggingFace-format GlmMoeDsa checkpoints (safetensors, single file or sharded).

Tensors are read lazily one at a time into a model built on the meta device, so peak memory is the model
plus one tensor. Routed experts are stored per expert on disk (mlp.experts.{e}.{gate,up,down}_proj.weight)
and stacked in memory. Multi-token-prediction layers (index >= num_hidden_layers) are skipped.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from glm5.errors import CheckpointError
from glm5.model.config import ModelConfig, RopeConfig
from glm5.model.model import DecoderLayer, GlmMoeDsaForCausalLM
from glm5.model.moe import MoE

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
PROGRESS_MIN_BYTES = 256 << 20


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


def _iter_tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device=str(device) if device.type == "cpu" else "cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
    rope: RopeConfig | None = None,
) -> GlmMoeDsaForCausalLM:
    """Builds the model of the checkpoint at `path`; `rope` replaces the checkpoint's RoPE parameters."""
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
        model = GlmMoeDsaForCausalLM(config)
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
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not show)
    with torch.no_grad(), bar:
        for name, tensor in _iter_tensors(files, device):
            bar.update(tensor.numel() * tensor.element_size())
            layer_match = _LAYER.match(name)
            if layer_match and int(layer_match.group(1)) >= config.num_hidden_layers:
                skipped_mtp += 1
                continue
            expert = _EXPERT.match(name)
            if expert:
                _load_expert(params, expert_parts, expert, tensor, name, config)
                continue
            target = params.get(name)
            if target is None:
                unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"tensor {name} has shape {tuple(tensor.shape)} in the checkpoint but the config needs "
                    f"{tuple(target.shape)}"
                )
            target.copy_(tensor)
            pending.discard(name)
    for stacked, parts in expert_parts.items():
        if len(parts) == config.n_routed_experts * 3:
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


def _load_expert(
    params: dict[str, torch.Tensor],
    expert_parts: dict[str, set[tuple[int, str]]],
    match: re.Match[str],
    tensor: torch.Tensor,
    name: str,
    config: ModelConfig,
) -> None:
    layer, e, which = int(match.group(1)), int(match.group(2)), match.group(3)
    prefix = f"model.layers.{layer}.mlp.experts"
    gate_up, down = params.get(f"{prefix}.gate_up_proj"), params.get(f"{prefix}.down_proj")
    if gate_up is None or down is None or e >= config.n_routed_experts:
        raise CheckpointError(f"tensor {name} does not fit the config (no such MoE layer or expert)")
    inter = config.moe_intermediate_size
    if which == "down":
        target = down[e]
    else:
        rows = slice(0, inter) if which == "gate" else slice(inter, 2 * inter)
        target = gate_up[e, rows]
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(
            f"tensor {name} has shape {tuple(tensor.shape)} in the checkpoint but the config needs "
            f"{tuple(target.shape)}"
        )
    target.copy_(tensor)
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
