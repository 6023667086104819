"""Loading and saving HuggingFace-format GlmMoeDsa checkpoints (safetensors, single file or sharded).

Tensors are read lazily one at a time into a model built on the meta device, so peak memory is the model
plus one tensor. Routed experts are stored per expert on disk (mlp.experts.{e}.{gate,up,down}_proj.weight)
and stacked in memory. Multi-token-prediction layers (index >= num_hidden_layers) are skipped unless asked
for (`mtp`); they then load like decoder layers, and their copy of the embeddings is not read (it is the
model's own).

Under tensor parallelism (glm5.parallel) a rank reads only its slices (safetensors' get_slice): a split
tensor's rows or columns, its own experts, never the whole checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from glm5.errors import CheckpointError
from glm5.model.config import ModelConfig, RopeConfig
from glm5.model.model import DecoderLayer, GlmMoeDsaForCausalLM
from glm5.model.moe import Experts, MoE
from glm5.model.quant import INT4_PER_WORD, SCALE_SUFFIX, Fp8Linear, Int4Linear, QuantConfig
from glm5.parallel import SINGLE, TensorParallel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight(_scale_inv|_packed|_scale|_shape)?$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Split by rows (output features) / columns (input features) under tensor parallelism; all else is replicated.
_ROWS = re.compile(
    r"^(model\.embed_tokens|lm_head|model\.layers\.\d+\.(shared_head\.head|self_attn\.(q_b_proj|kv_b_proj)"
    r"|mlp\.(shared_experts\.)?(gate_proj|up_proj)))\.weight(_scale_inv|_packed|_scale|_shape)?$"
)
_COLUMNS = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.o_proj|mlp\.(shared_experts\.)?down_proj)\.weight(_scale_inv|_packed|_scale|_shape)?$"
)
_ROW_PARALLEL_BIAS = re.compile(r"^model\.layers\.\d+\.self_attn\.o_proj\.bias$")
PROGRESS_MIN_BYTES = 256 << 20
# safetensors' dtype names, as stored in a checkpoint's headers
STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                 "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}  # fmt: skip
_DTYPE_BYTES = {name: dtype.itemsize for name, dtype in STORED_DTYPES.items()}


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


class TensorSource(Protocol):
    """One checkpoint tensor as the loader reads it: its shape, safetensors dtype name and the part it needs."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor: ...


class Lazy:
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


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, Lazy]]:
    """Every tensor of the checkpoint files, not read yet."""
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, Lazy(f, name)


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
    mtp: str = "skip",
) -> GlmMoeDsaForCausalLM:
    """Builds the model of the checkpoint at `path` (this rank's shard under `tp`); `rope` replaces the
    checkpoint's RoPE parameters; `mtp` as build_model's."""
    path = Path(path)
    config = ModelConfig.from_file(path)
    if rope is not None:
        config.rope = rope
    raw = json.loads((path / "config.json").read_text())
    quant = QuantConfig.from_config(raw.get("quantization_config"))
    files = checkpoint_files(path)
    total = sum(f.stat().st_size for f in files)
    return build_model(config, iter_tensors(files), stored_dtypes(files), dtype, device, quant=quant, tp=tp,
                       total_bytes=total, progress=progress, source=f"checkpoint {path}", mtp=mtp)  # fmt: skip


MTP_MODES = ("skip", "auto", "stored", "require")


def mtp_layers_stored(config: ModelConfig, stored: Iterable[str]) -> list[bool]:
    """For each MTP layer the config declares, whether the checkpoint has any tensor of it."""
    n, found = config.num_hidden_layers, set()
    for name in stored:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= n:
            found.add(int(m.group(1)) - n)
    return [i in found for i in range(config.num_nextn_predict_layers)]


def _mtp_to_build(config: ModelConfig, stored: dict[str, str], mtp: str, source: str) -> tuple[int, bool]:
    """(how many MTP layers to build, whether with their own LM heads) under `mtp`: "skip" none; "auto" the
    ones the checkpoint stores (a warning when the config declares layers it lacks: community quantizations
    often drop them); "require" every declared one (the missing-tensors check then names what is absent)."""
    if mtp not in MTP_MODES:
        raise ValueError(f"mtp {mtp!r}: one of {', '.join(MTP_MODES)}")
    declared = config.num_nextn_predict_layers
    if mtp == "skip" or (mtp in ("auto", "stored") and not declared):
        return 0, False
    if not declared:
        raise CheckpointError(f"{source} has no multi-token-prediction layers (config.json num_nextn_predict_layers "
                              "is 0): speculative decoding by MTP needs a checkpoint that has them")  # fmt: skip
    present = mtp_layers_stored(config, stored)
    built = declared if mtp == "require" else next((i for i, p in enumerate(present) if not p), declared)
    if built < declared and mtp == "auto":
        log.warning("%s declares %d multi-token-prediction layers but stores weights for %d of them: serving "
                    "without the others (MTP speculative decoding %s)", source, declared, built,
                    "drafts with the ones stored" if built else "is off")  # fmt: skip
    first = config.num_hidden_layers
    heads = {f"model.layers.{first + i}.shared_head.head.weight" in stored for i in range(built)}
    if len(heads) > 1:
        raise CheckpointError(f"{source}: some MTP layers store their own shared_head.head and some do not")
    return built, heads == {True}


def build_model(
    config: ModelConfig,
    tensors: Iterable[tuple[str, TensorSource]],
    stored: dict[str, str],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    quant: QuantConfig | None = None,
    tp: TensorParallel = SINGLE,
    total_bytes: int = 0,
    progress: bool | None = None,
    source: str = "checkpoint",
    mtp: str = "skip",
) -> GlmMoeDsaForCausalLM:
    """The model of `config` (this rank's shard under `tp`) from checkpoint tensors under their on-disk names,
    read one at a time in the order given (`stored`: every tensor's safetensors dtype, known up front because it
    decides which layers are quantized). A file's tensors, or ones arriving over a weight-sync group. `mtp`:
    the multi-token-prediction layers, "skip" (not built, their tensors not read), "auto" (those stored, a
    warning when some declared are not), "stored" (those stored, silently: a weight update, which keeps the
    served layers it does not carry) or "require" (all the config declares, or an error naming the missing
    tensors)."""
    device = torch.device(device)
    mtp_built, mtp_heads = _mtp_to_build(config, stored, mtp, source)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(config, tp, mtp_built, mtp_heads)
    model = model.to(dtype)
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        indexer = layer.self_attn.indexer
        if indexer is not None:
            indexer.weights_proj.float()
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate.e_score_correction_bias = layer.mlp.gate.e_score_correction_bias.float()
    _use_stored_formats(model, stored, quant, dtype)
    model = model.to_empty(device=device)
    params: dict[str, torch.Tensor] = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    pending = set(params)
    expert_parts: dict[str, set[tuple[int, str]]] = {}
    logical_shapes: dict[str, tuple[int, ...]] = {}  # compressed-tensors' weight_shape, by module
    skipped_mtp = 0
    unexpected: list[str] = []
    show = progress if progress is not None else total_bytes >= PROGRESS_MIN_BYTES
    desc = "loading weights" if tp.size == 1 else f"loading weights (rank {tp.rank})"
    # built only when shown: any tqdm creates a multiprocessing lock, which a rank process that ends with
    # os._exit leaves behind for the resource tracker to warn about
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc) if show else _NoBar()
    with torch.no_grad(), bar:
        for stored_name, lazy in tensors:
            name = _canonical(stored_name, stored)
            bar.update(lazy.nbytes)  # scanned, whether this rank reads it all, a part or nothing
            layer_match = _LAYER.match(name)
            # an MTP layer not built, or an MTP layer's copy of the embeddings (the model's own serves it)
            layer_index = int(layer_match.group(1)) if layer_match else -1
            if layer_index >= config.num_hidden_layers + mtp_built or (
                layer_index >= config.num_hidden_layers and name.endswith(".embed_tokens.weight")
            ):
                skipped_mtp += 1
                continue
            if name.endswith(".weight_shape"):
                value = lazy.read()
                if value.device.type != "meta":  # a dry run (shard_reads) has no values to check
                    logical_shapes[name.removesuffix(".weight_shape")] = tuple(int(v) for v in value.tolist())
                continue
            expert = _EXPERT.match(name)
            if expert:
                mlp = model.model.layers[int(expert.group(1))].mlp
                if not isinstance(mlp, MoE):
                    raise CheckpointError(f"tensor {name} does not fit the config (layer {expert.group(1)} is dense)")
                _load_expert(params, expert_parts, expert, lazy, name, mlp.experts, tp)
                continue
            target = params.get(name)
            if target is None:
                unexpected.append(name)
                continue
            full, index = tuple(target.shape), tuple[slice, ...]()
            if tp.size > 1 and (_ROWS.match(name) or _COLUMNS.match(name)):
                dim = 0 if _ROWS.match(name) else 1
                grouped = _grouped(model, name, dim)
                if grouped is None:
                    full, index = _split(target, dim, tp)
                else:
                    full, index = _split_grouped(name, target, *grouped, dim, tp)
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
    _check_logical_shapes(model, logical_shapes, tp)
    if "lm_head.weight" in pending and config.tie_word_embeddings:
        model.tie_weights()
        pending.discard("lm_head.weight")
    if pending:
        listed = ", ".join(sorted(pending)[:8])
        mtp_missing = [n for n in pending if (m := _LAYER.match(n)) and int(m.group(1)) >= config.num_hidden_layers]
        if mtp_missing and mtp == "require":
            raise CheckpointError(f"{source} lacks weights of its multi-token-prediction layers, which MTP "
                                  f"speculative decoding needs: {len(pending)} missing, e.g. {listed}")  # fmt: skip
        raise CheckpointError(f"{source} is missing {len(pending)} tensors: {listed}")
    if dtype == torch.bfloat16 and device.type == "cpu":
        for module in model.modules():
            if isinstance(module, Int4Linear | Experts):
                module.use_cpu_kernel()
    if skipped_mtp:
        log.info("ignored %d tensors of multi-token-prediction layers (not built, or the embeddings' copy)",
                 skipped_mtp)  # fmt: skip
    if unexpected:
        log.warning("ignored %d unknown tensors, e.g. %s", len(unexpected), unexpected[0])
    return model.eval()


class _Recorder:
    """A checkpoint tensor in a dry run of build_model: records the part a rank reads, reads nothing."""

    def __init__(self, lazy: TensorSource) -> None:
        self.lazy = lazy
        self.index: tuple[slice, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.lazy.shape

    @property
    def dtype(self) -> str:
        return self.lazy.dtype

    @property
    def nbytes(self) -> int:
        return self.lazy.nbytes

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor:
        self.index = index
        part = torch.empty(self.shape, dtype=parse_stored(self.dtype), device="meta")
        return part[index] if index else part


def shard_reads(
    config: ModelConfig,
    tensors: Iterable[tuple[str, TensorSource]],
    stored: dict[str, str],
    dtype: torch.dtype,
    *,
    quant: QuantConfig | None = None,
    tp: TensorParallel = SINGLE,
) -> dict[str, tuple[slice, ...]]:
    """What build_model reads of each tensor for rank `tp.rank` (its index; () is the whole tensor; a tensor it
    does not read is absent), found by running it on the meta device: the very rules that load a shard, so a
    rank can ask a sender for exactly its part. No tensor's bytes are read (the sources may have none: a weight
    sync's manifest), so the checks of stored values wait for the real load."""
    recorders: list[tuple[str, _Recorder]] = []

    def recording() -> Iterator[tuple[str, _Recorder]]:  # lazily: a file's tensors are readable while it is open
        for name, lazy in tensors:
            recorders.append((name, _Recorder(lazy)))
            yield recorders[-1]

    build_model(config, recording(), stored, dtype, "meta", quant=quant, tp=tp, progress=False)
    return {name: r.index for name, r in recorders if r.index is not None}


def parse_stored(name: str) -> torch.dtype:
    """A safetensors dtype name (F32, BF16, F8_E4M3, I32, ...) as torch's dtype."""
    if name not in STORED_DTYPES:
        raise CheckpointError(f"unknown stored dtype {name}")
    return STORED_DTYPES[name]


def _local_experts(model: GlmMoeDsaForCausalLM, stacked: str) -> int:
    """Experts this rank holds in the MoE layer that `stacked` (...mlp.experts.gate_up_proj) belongs to."""
    return _experts(model, int(stacked.split(".")[2])).num_experts


def _experts(model: GlmMoeDsaForCausalLM, layer_index: int) -> Experts:
    layer = model.model.layers[layer_index]
    assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp, MoE)
    return layer.mlp.experts


def stored_dtypes(files: list[Path]) -> dict[str, str]:
    """Every tensor's stored dtype (safetensors' names: F8_E4M3, BF16, ...), from the headers only."""
    out: dict[str, str] = {}
    for name, lazy in iter_tensors(files):
        out[name] = lazy.dtype
    return out


def _canonical(name: str, stored: dict[str, str]) -> str:
    """compressed-tensors names a float8 weight's block scales `weight_scale`; they are the same numbers as
    GLM-5-FP8's `weight_scale_inv` (weight = fp8 x scale), so both load into one parameter."""
    if name.endswith(".weight_scale") and stored.get(name.removesuffix("_scale")) == "F8_E4M3":
        return name + "_inv"
    return name


def _use_stored_formats(
    model: GlmMoeDsaForCausalLM, stored: dict[str, str], quant: QuantConfig | None, dtype: torch.dtype
) -> None:
    """Swaps in quantized layers (on the meta device) where the checkpoint stores a float8 weight or a packed
    INT4 one: what is quantized is what the file holds, whatever `modules_to_not_convert` or `ignore` list."""
    fp8 = [name for name, d in stored.items() if d == "F8_E4M3"]
    packed = [name for name in stored if name.endswith(".weight_packed")]
    if not fp8 and not packed:
        return
    if quant is None:
        first, what = (fp8[0], "float8") if fp8 else (packed[0], "packed INT4")
        raise CheckpointError(f"tensor {first} is {what} but config.json has no quantization_config")
    for name in fp8:
        if name.endswith(".weight") and not {name + SCALE_SUFFIX, name + "_scale"} & stored.keys():
            raise CheckpointError(f"tensor {name} is float8 but {name}{SCALE_SUFFIX} is missing from the checkpoint")
    for name in packed:
        if name.replace("_packed", "_scale") not in stored:
            raise CheckpointError(f"tensor {name} is packed INT4 but {name.replace('_packed', '_scale')} is missing")
    for mod_name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            replacement: nn.Module | None = None
            with torch.device("meta"):
                if stored.get(f"{mod_name}.weight") == "F8_E4M3":
                    block = quant.fp8_block(mod_name)
                    replacement = Fp8Linear(module.in_features, module.out_features, module.bias is not None, block,
                                            dtype)  # fmt: skip
                elif f"{mod_name}.weight_packed" in stored:
                    group = quant.int4_group(mod_name)
                    replacement = Int4Linear(module.in_features, module.out_features, module.bias is not None, group,
                                             dtype)  # fmt: skip
            if replacement is not None:
                parent, _, attr = mod_name.rpartition(".")
                setattr(model.get_submodule(parent), attr, replacement)
        elif isinstance(module, Experts):
            first = f"{mod_name}.{module.first_expert}.gate_proj"
            if stored.get(f"{first}.weight") == "F8_E4M3":
                module.to_fp8(quant.fp8_block(first))
            elif f"{first}.weight_packed" in stored:
                module.to_int4(quant.int4_group(first))


def _grouped(model: GlmMoeDsaForCausalLM, name: str, dim: int) -> tuple[int, int | None] | None:
    """For a tensor stored per group of values along `dim` (FP8 block scales, packed INT4 words and their
    scales): this rank's logical size along `dim` and the group's size there (None: one group spans the whole
    dimension, as INT4 channel scales do along a row); None for plain tensors."""
    module_name, _, param = name.rpartition(".")
    module = model.get_submodule(module_name)
    if not isinstance(module, Fp8Linear | Int4Linear):
        return None
    local = module.out_features if dim == 0 else module.in_features
    if isinstance(module, Fp8Linear) and param == "weight_scale_inv":
        return local, module.block[dim]
    if isinstance(module, Int4Linear) and param in ("weight_packed", "weight_scale"):
        return local, 1 if dim == 0 else INT4_PER_WORD if param == "weight_packed" else module.group
    return None


def _split_grouped(
    name: str, target: torch.Tensor, weight_local: int, size: int | None, dim: int, tp: TensorParallel
) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """The rows or columns of groups (block scales, packed words, group scales) that cover this rank's part
    of a split weight; an error if the split cuts a group (the rank would need values it does not hold, or a
    block's scale from an offset its layer does not know). A group that spans the whole dimension (`size`
    None: a channel scale) is every rank's, read whole: the same scale applies to each part of the row."""
    start, stop, total = tp.rank * weight_local, (tp.rank + 1) * weight_local, weight_local * tp.size
    if size is None:
        return tuple(target.shape), tuple[slice, ...]()
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


def _check_logical_shapes(model: GlmMoeDsaForCausalLM, shapes: dict[str, tuple[int, ...]], tp: TensorParallel) -> None:
    """compressed-tensors stores each packed weight's unpacked shape; it must be the shape the config gives."""
    config = model.config
    for module_name, shape in shapes.items():
        expert = _EXPERT.match(module_name + ".weight")
        if expert:
            inter, hidden = config.moe_intermediate_size, config.hidden_size
            want: tuple[int, ...] = (hidden, inter) if expert.group(3) == "down" else (inter, hidden)
        else:
            module = model.get_submodule(module_name) if _has_module(model, module_name) else None
            if not isinstance(module, Int4Linear):
                raise CheckpointError(f"tensor {module_name}.weight_shape belongs to no packed INT4 weight")
            rows, cols = module.out_features, module.in_features
            if _ROWS.match(module_name + ".weight"):
                rows *= tp.size
            elif _COLUMNS.match(module_name + ".weight"):
                cols *= tp.size
            want = (rows, cols)
        if shape != want:
            raise CheckpointError(f"tensor {module_name}.weight_shape says {shape} but the config needs {want}")


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


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


_EXPERT_PARAM = {None: "", "_scale_inv": "_scale_inv", "_packed": "_packed", "_scale": "_scale"}


def _load_expert(
    params: dict[str, torch.Tensor],
    expert_parts: dict[str, set[tuple[int, str]]],
    match: re.Match[str],
    lazy: TensorSource,
    name: str,
    experts: Experts,
    tp: TensorParallel,
) -> None:
    """Reads this rank's part of one expert's projection, its FP8 scales or its packed INT4 words and scales
    (nothing if another rank holds the expert)."""
    layer, e, which, kind = int(match.group(1)), int(match.group(2)), match.group(3), match.group(4)
    prefix = f"model.layers.{layer}.mlp.experts"
    suffix = _EXPERT_PARAM[kind]
    gate_up, down = params.get(f"{prefix}.gate_up_proj{suffix}"), params.get(f"{prefix}.down_proj{suffix}")
    first, stop = experts.first_expert, experts.first_expert + experts.num_experts
    if gate_up is None or down is None or e >= experts.total_experts:
        raise CheckpointError(f"tensor {name} does not fit the config (its experts are stored in another format, "
                              "or there is no such MoE layer or expert)")  # fmt: skip
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
        inter, hidden = experts.dims
        local = (inter if which == "down" else hidden) if dim == 1 else (hidden if which == "down" else inter)
        size: int | None = 1
        if kind == "_scale_inv":
            assert experts.fp8_block is not None
            size = experts.fp8_block[dim]
        elif kind in ("_packed", "_scale") and dim == 1:
            assert experts.is_int4
            size = INT4_PER_WORD if kind == "_packed" else experts.int4_group
        full, index = _split_grouped(name, target, local, size, dim, tp)
    if lazy.shape != full:
        raise CheckpointError(f"tensor {name} has shape {lazy.shape} in the checkpoint but the config needs {full}")
    target.copy_(lazy.read(index))
    expert_parts.setdefault(f"{prefix}.gate_up_proj{suffix}", set()).add((e, which))


def on_disk(name: str, tensor: torch.Tensor, moe_intermediate_size: int) -> dict[str, torch.Tensor]:
    """One state-dict entry under its on-disk names: stacked experts split per expert (gate and up halves apart),
    everything else as it is. The same for our model and transformers' (both stack the experts)."""
    if name.endswith(".experts.gate_up_proj"):
        prefix = name.removesuffix(".gate_up_proj")
        out = {}
        for e in range(tensor.shape[0]):
            out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :moe_intermediate_size]
            out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, moe_intermediate_size:]
        return out
    if name.endswith(".experts.down_proj"):
        prefix = name.removesuffix(".down_proj")
        return {f"{prefix}.{e}.down_proj.weight": tensor[e] for e in range(tensor.shape[0])}
    return {name: tensor}


def checkpoint_state_dict(model: GlmMoeDsaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under their on-disk names (experts split per expert), contiguous, on CPU."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        out.update(on_disk(name, tensor, model.config.moe_intermediate_size))
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
