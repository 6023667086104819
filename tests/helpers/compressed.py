"""compressed-tensors checkpoints made by the library itself (its compressors, its config model), and their
float twins decompressed by the library: the independent side of the quantized-format tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from glm5.model.quant import FP8
from safetensors.torch import load_file, save_file


def int4_scheme(targets: list[str], group: int) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    return QuantizationScheme(targets=targets, weights=args, format="pack-quantized")


def int4_channel_scheme(targets: list[str]) -> QuantizationScheme:
    """INT4 with one scale per output row (compressed-tensors' `channel` strategy: any number of columns)."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel")
    return QuantizationScheme(targets=targets, weights=args, format="pack-quantized")


def fp8_scheme(targets: list[str], block: int) -> QuantizationScheme:
    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[block] * 2)
    inputs = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group", group_size=block,
                              dynamic=True)  # fmt: skip
    return QuantizationScheme(targets=targets, weights=weights, input_activations=inputs, format="float-quantized")


# 2-D weights that are not nn.Linear modules in transformers' model (what the `Linear` target means), and lm_head,
# which the configs written here ignore
NOT_LINEAR = re.compile(r"(embed_tokens|mlp\.gate|lm_head)$")


def _matches(scheme: QuantizationScheme, module: str) -> bool:
    # compressed-tensors' targets: a regex on the module name, a class name (every weight here is a Linear's) or a name
    return any(re.match(t[3:], module) if t.startswith("re:") else t in ("Linear", module) for t in scheme.targets)


def _scale(w: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
    """Per-group absmax scales, as llm-compressor's min-max observer computes them (the library quantizes)."""
    args = scheme.weights
    if args.type == "int" and args.strategy == "channel":
        return (w.abs().amax(-1, keepdim=True) / 7.5).clamp(min=1e-8)
    if args.type == "int":
        groups = w.view(w.shape[0], -1, args.group_size).abs().amax(-1)
        return (groups / 7.5).clamp(min=1e-8)
    br, bc = args.block_structure
    tiles = torch.nn.functional.pad(w, (0, -w.shape[1] % bc, 0, -w.shape[0] % br))
    tiles = tiles.view(tiles.shape[0] // br, br, tiles.shape[1] // bc, bc).abs().amax(dim=(1, 3))
    return (tiles / 448.0).clamp(min=1e-8)


def write_compressed(src: Path, out: Path, schemes: list[QuantizationScheme]) -> Path:
    """The float checkpoint at `src` compressed by compressed-tensors (first matching scheme per linear)."""
    out.mkdir()
    written: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and t.dim() == 2 and not NOT_LINEAR.search(module)
        scheme = next((s for s in schemes if linear and _matches(s, module)), None)
        if scheme is None:
            written[name] = t
            continue
        compressor = BaseCompressor.load_from_registry(scheme.format)
        for key, value in compressor.compress({"weight": t, "weight_scale": _scale(t, scheme)}, scheme).items():
            written[f"{module}.{key}"] = value
    # the library returns views for partial blocks (weight[:rows, :cols] of the padded tiles)
    written = {k: v.contiguous() for k, v in written.items()}
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    groups = {f"group_{i}": s for i, s in enumerate(schemes)}
    formats = {s.format for s in schemes}
    qc = QuantizationConfig(config_groups=groups, format=formats.pop() if len(formats) == 1 else "mixed-precision",
                            ignore=["lm_head"], quantization_status="compressed")  # fmt: skip
    config["quantization_config"] = qc.model_dump(exclude_none=True)
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_decompressed(src: Path, out: Path) -> Path:
    """The reference: a float checkpoint of exactly the values the compressed one holds, decompressed by the
    library (not by our unpacking)."""
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config.pop("quantization_config"))
    tensors = load_file(str(src / "model.safetensors"))
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed") or (name.endswith(".weight") and t.dtype == FP8):
            module = name.rpartition(".")[0]
            scheme = next(s for s in qc.config_groups.values() if _matches(s, module))
            compressor = BaseCompressor.load_from_registry(scheme.format)
            state = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == module}
            plain[module + ".weight"] = compressor.decompress(state, scheme)["weight"].float().contiguous()
        elif not re.search(r"\.weight_(scale|shape)$", name):
            plain[name] = t
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out
