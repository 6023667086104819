"""`glm5 quantize`: recipes pick the layers, the numbers are right (GPTQ beats round-to-nearest on the
calibration inputs), and what it writes is what independent readers read: the compressed-tensors library
validates the config and decompresses the INT4 / FP8 tensors to the weights our loader holds; block-FP8
output dequantized longhand matches too; shards stay under --max-shard-size with a complete index."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from glm5.errors import ConfigError
from glm5.model.loader import load_model
from glm5.model.quant import Fp8Linear, Int4Linear, dequantize_int4
from glm5.quantize.methods import fp8_block, int4_gptq, int4_rtn
from glm5.quantize.quantizer import quantize_checkpoint
from glm5.quantize.recipe import load_recipe
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.helpers.oracle import hf_checkpoint, step_logits
from tests.unit.model.test_fp8 import dequant_blocks

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

from tests.helpers.compressed import write_decompressed  # noqa: E402

CONFIG = dict(num_hidden_layers=3, index_topk_pattern="FFS", index_topk=12, first_k_dense_replace=1, n_group=2,
              topk_group=1)  # fmt: skip


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quantize") / "float"
    hf_checkpoint(path, seed=6, **CONFIG)
    return path


def test_default_recipes_exclude_what_their_comments_say() -> None:
    w4 = load_recipe("w4a16", None)
    mix = load_recipe("w4a16-fp8-mix", None)
    fp8 = load_recipe("fp8-block", None)
    layer = "model.layers.2"
    assert w4.format_of(f"{layer}.mlp.experts.7.down_proj") == "int4"
    assert w4.format_of(f"{layer}.self_attn.q_b_proj") == "int4"
    for kept in ("self_attn.kv_b_proj", "self_attn.indexer.wk", "self_attn.indexer.weights_proj", "mlp.gate"):
        assert w4.format_of(f"{layer}.{kept}") is None, kept
    assert w4.format_of(f"{layer}.mlp.gate_proj") == "int4"  # `*mlp.gate` is the router only
    assert mix.format_of(f"{layer}.mlp.experts.0.gate_proj") == "int4"
    assert mix.format_of(f"{layer}.mlp.shared_experts.up_proj") == "fp8"
    assert mix.format_of(f"{layer}.self_attn.kv_b_proj") == "fp8"
    assert fp8.format_of("lm_head") is None and fp8.format_of(f"{layer}.self_attn.indexer.wk") == "fp8"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("scheme: int3\ninclude: ['*']\n", "scheme must be one of"),
        ("scheme: w4a16\ninclude: ['*']\nexlude: ['*gate']\n", "unknown keys exlude"),
        ("scheme: w4a16\ninclude: []\n", "include must list at least one"),
        ("scheme: w4a16\ninclude: ['*']\nint4: ['*experts*']\n", "int4 globs only apply to scheme w4a16-fp8-mix"),
        ("scheme: w4a16\ninclude: ['*']\ngroup_size: 100\n", "group_size must be a positive multiple of 8"),
        ("scheme: w4a16\ninclude: ['*']\ncalibration: {method: awq}\n", "calibration method must be gptq or rtn"),
        ("[unclosed", "not valid YAML"),
    ],
)
def test_bad_recipes_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_recipe(None, path)


def test_methods_round_trip_and_gptq_beats_rounding_on_its_inputs() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    q, s = int4_rtn(w, 32)
    assert q.min() >= -8 and q.max() <= 7 and s.shape == (48, 4)
    assert (q.float() * s.repeat_interleave(32, 1) - w).abs().max() <= s.max() / 2 + 1e-6
    f, fs = fp8_block(torch.randn(40, 72), (16, 32))  # partial blocks both ways
    assert fs.shape == (3, 3) and f.dtype == torch.float8_e4m3fn
    # correlated inputs: GPTQ spreads each column's rounding error onto the columns that can absorb it
    mix = torch.randn(128, 128) * (torch.rand(128) * 3)
    x = torch.randn(2048, 128) @ mix
    gq, gs = int4_gptq(w, x.t() @ x, 32)
    rtn_err = (x @ (q.float() * s.repeat_interleave(32, 1)).t() - x @ w.t()).pow(2).mean()
    gptq_err = (x @ (gq.float() * gs.repeat_interleave(32, 1)).t() - x @ w.t()).pow(2).mean()
    assert gptq_err < 0.7 * rtn_err


def _shard_check(out: Path, limit: int) -> dict[str, str]:
    files = sorted(out.glob("*.safetensors"))
    assert all(f.stat().st_size <= limit for f in files), [f.stat().st_size for f in files]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {f.name for f in files}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
        assert names == {n for n, shard in index.items() if shard == file.name}
    return index


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-fp8-mix"])
def test_compressed_tensors_output_is_what_the_library_reads(
    float_checkpoint: Path, tmp_path: Path, scheme: str
) -> None:
    out = tmp_path / scheme
    limit = 160_000 + (1 << 20)  # the writer keeps 1 MiB of each shard for the header
    recipe = load_recipe(scheme, None).with_group_size(16)
    summary = quantize_checkpoint(
        float_checkpoint, out, recipe, max_shard_bytes=limit, progress=False, log=lambda _: None
    )
    index = _shard_check(out, limit)
    assert len(summary.shards) > 1 and any(n.endswith(".weight_packed") for n in index)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)  # the format's own library accepts it
    assert "model.layers.1.mlp.gate" in qc["ignore"] and "lm_head" in qc["ignore"]
    assert (out / "tokenizer.json").is_file() == (float_checkpoint / "tokenizer.json").is_file()
    model = load_model(out)
    # the library decompresses our tensors into the weights our loader holds
    flat = tmp_path / "flat"  # the helper reads one file
    flat.mkdir()
    merged = {k: v for f in sorted(out.glob("model-*.safetensors")) for k, v in load_file(str(f)).items()}
    save_file(merged, str(flat / "model.safetensors"))
    (flat / "config.json").write_text((out / "config.json").read_text())
    reference = load_model(write_decompressed(flat, tmp_path / "ref"))
    for a, b in zip(step_logits(model), step_logits(reference), strict=True):
        assert (a - b).abs().max().item() <= 1e-4
    o_proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, Fp8Linear if scheme == "w4a16-fp8-mix" else Int4Linear)
    original = load_file(str(float_checkpoint / "model.safetensors"))["model.layers.1.mlp.experts.2.down_proj.weight"]
    experts = model.model.layers[1].mlp.experts
    got = dequantize_int4(experts.down_proj_packed[2], experts.down_proj_scale[2], experts.dims[0], 16, torch.float32)
    assert (got - original).abs().max() <= experts.down_proj_scale[2].max() / 2 + 1e-6


def test_block_fp8_output_is_glm5_fp8s_format(float_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    recipe = load_recipe("fp8-block", None)
    quantize_checkpoint(float_checkpoint, out, recipe, progress=False, log=lambda _: None)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert tensors[name].dtype == torch.float8_e4m3fn and tensors[name + "_scale_inv"].shape == (1, 1)
    layer = load_model(out).model.layers[0].self_attn.kv_a_proj_with_mqa
    assert isinstance(layer, Fp8Linear)
    want = dequant_blocks(tensors[name], tensors[name + "_scale_inv"], (128, 128))  # longhand, independent
    assert torch.equal(layer.dense_weight(torch.float32), want)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "glm5_cli", "quantize", *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.slow
def test_cli_calibrates_with_gptq_and_refuses_bad_input(tmp_path: Path) -> None:
    from glm5.tokenizer.build import write_tokenizer

    float_checkpoint = tmp_path / "float"
    hf_checkpoint(float_checkpoint, seed=6, **{**CONFIG, "vocab_size": 1024})  # the byte-level tokenizer's vocabulary
    write_tokenizer(float_checkpoint)
    calibration = tmp_path / "cal.jsonl"
    calibration.write_text("\n".join(json.dumps({"prompt": f"What is {i} + {i + 3}?"}) for i in range(20)) + "\n")
    args = ["--model", str(float_checkpoint), "--scheme", "w4a16", "--group-size", "16", "--no-progress"]
    done = _cli(*args, "--out", str(tmp_path / "gptq"), "--calibration", str(calibration))
    assert done.returncode == 0, done.stderr
    assert "on 20 prompts (GPTQ)" in done.stderr and "quantized layers:" in done.stdout
    rtn = _cli(*args, "--out", str(tmp_path / "rtn"))
    assert rtn.returncode == 0 and "round-to-nearest" in rtn.stderr
    a = load_file(str(tmp_path / "gptq" / "model.safetensors"))["model.layers.1.mlp.experts.0.gate_proj.weight_packed"]
    b = load_file(str(tmp_path / "rtn" / "model.safetensors"))["model.layers.1.mlp.experts.0.gate_proj.weight_packed"]
    assert not torch.equal(a, b)
    bad = _cli(*args, "--out", str(tmp_path / "x"), "--calibration", str(tmp_path / "missing.jsonl"))
    assert bad.returncode == 2 and "cannot read calibration file" in bad.stderr
    again = _cli(*args, "--out", str(tmp_path / "rtn"))
    assert again.returncode == 2 and "already holds a checkpoint" in again.stderr
    coarse = _cli(*args[:-3], "--group-size", "128", "--no-progress", "--out", str(tmp_path / "y"))
    assert coarse.returncode == 2 and "not a multiple of group_size 128" in coarse.stderr
    requant = _cli("--model", str(tmp_path / "rtn"), "--scheme", "fp8-block", "--out", str(tmp_path / "z"))
    assert requant.returncode == 2 and "already quantized" in requant.stderr
