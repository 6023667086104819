"""Block-FP8 checkpoints (GLM-5-FP8's format), written here with plain torch from a float model: loaded as 1 byte
per value, the logits equal a float model built from the dequantized weights, on one device and over two ranks;
broken checkpoints fail naming the tensor."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from glm5.errors import CheckpointError
from glm5.model.loader import load_model
from glm5.model.quant import FP8, Fp8Linear
from glm5.parallel import TensorParallel
from safetensors.torch import load_file, save_file

from tests.helpers.oracle import engine_greedy, hf_checkpoint, rewrite_checkpoint, step_logits
from tests.helpers.ranks import run_ranks

BLOCK = (16, 16)
# what GLM-5-FP8 quantizes: attention projections, the indexer's wq_b and wk, shared and routed experts
QUANTIZED = re.compile(
    r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.(wq_b|wk))\.weight$"
    r"|mlp\.(shared_experts|experts\.\d+)\.(gate|up|down)_proj\.weight$"
)
CONFIG = dict(num_hidden_layers=3, index_topk_pattern="FFS", index_topk=12, first_k_dense_replace=1, n_group=2,
              topk_group=1)  # fmt: skip


def fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a float matrix the way the published checkpoints do (amax / 448 per block), written out
    longhand rather than with glm5.model.quant so the two are independent."""
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].float()
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (tile / scale[i, j]).to(FP8)
    return q, scale


def dequant_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


def write_fp8(src: Path, out: Path, block: tuple[int, int] = BLOCK) -> Path:
    """The float checkpoint at `src` as block FP8 at `out`."""
    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if QUANTIZED.search(name):
            quantized[name], quantized[name + "_scale_inv"] = fp8_blocks(t, block)
        else:
            quantized[name] = t
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head"],
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_dequantized(fp8: Path, out: Path, block: tuple[int, int] = BLOCK) -> Path:
    """The reference: a float checkpoint holding exactly the values the FP8 one represents."""
    out.mkdir()
    tensors = load_file(str(fp8 / "model.safetensors"))
    plain = {n: dequant_blocks(t, tensors[n + "_scale_inv"], block) if t.dtype == FP8 else t
             for n, t in tensors.items() if not n.endswith("_scale_inv")}  # fmt: skip
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    hf_checkpoint(root / "float", seed=4, **CONFIG)
    fp8 = write_fp8(root / "float", root / "fp8")
    return fp8, write_dequantized(fp8, root / "dequantized")


def test_fp8_checkpoint_loads_as_one_byte_per_value_and_matches_its_dequantized_weights(
    checkpoints: tuple[Path, Path],
) -> None:
    fp8, dequantized = checkpoints
    model = load_model(fp8)
    ref = load_model(dequantized)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa, Fp8Linear)  # 40 rows: a partial last block
    assert attn.kv_a_proj_with_mqa.weight.dtype == FP8 and attn.kv_a_proj_with_mqa.weight_scale_inv.shape == (3, 4)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == FP8
    assert model.lm_head.weight.dtype == torch.float32  # what the file stores decides, not a list of names
    for got, want in zip(step_logits(model), step_logits(ref), strict=True):
        assert (got - want).abs().max().item() <= 1e-4
    assert (step_logits(model)[0].argmax(-1) == step_logits(ref)[0].argmax(-1)).all()


def _rank(rank: int, world: int, path: str, expert_parallel: bool) -> list[torch.Tensor]:
    return step_logits(load_model(path, tp=TensorParallel(rank, world, expert_parallel)))


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [True, False], ids=["experts-partitioned", "experts-split"])
def test_fp8_over_two_ranks_reads_whole_blocks(
    checkpoints: tuple[Path, Path], tmp_path: Path, expert_parallel: bool
) -> None:
    """Each rank reads its rows or columns of a weight and the block scales covering them (an expert split by
    its intermediate dimension included)."""
    fp8, dequantized = checkpoints
    ref = step_logits(load_model(dequantized))
    got = run_ranks(_rank, 2, str(fp8), expert_parallel)[0]
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max().item() <= 1e-4
    # 32-row blocks: q_b_proj's 96 rows split 48 / 48 would cut a block in two
    coarse = write_fp8(fp8.parent / "float", tmp_path / "coarse", block=(32, 32))
    with pytest.raises(CheckpointError, match=r"q_b_proj\.weight_scale_inv: rank 1's rows \[48, 96\) of 96 cut"):
        load_model(coarse, tp=TensorParallel(1, 2))


def test_broken_fp8_checkpoints_name_the_tensor(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    fp8, _ = checkpoints
    name = "model.layers.0.self_attn.q_b_proj.weight"

    def drop_scale(t: dict[str, torch.Tensor]) -> None:
        del t[name + "_scale_inv"]

    def bad_scale(t: dict[str, torch.Tensor]) -> None:
        t[name + "_scale_inv"] = torch.ones(2, 2)

    with pytest.raises(CheckpointError, match=re.escape(f"{name} is float8 but {name}_scale_inv is missing")):
        load_model(rewrite_checkpoint(fp8, tmp_path / "a", drop_scale))
    with pytest.raises(CheckpointError, match=re.escape(f"{name}_scale_inv has shape (2, 2)")):
        load_model(rewrite_checkpoint(fp8, tmp_path / "b", bad_scale))
    no_config = rewrite_checkpoint(fp8, tmp_path / "c", lambda t: None)
    config = json.loads((no_config / "config.json").read_text())
    del config["quantization_config"]
    (no_config / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is float8 but config.json has no quantization_config"):
        load_model(no_config)


def test_engine_serves_an_fp8_checkpoint_like_its_dequantized_twin(checkpoints: tuple[Path, Path]) -> None:
    (fp8_tokens, fp8_bytes), (ref_tokens, ref_bytes) = (engine_greedy(path) for path in checkpoints)
    assert "float8_e4m3fn" in fp8_bytes and "float8_e4m3fn" not in ref_bytes
    assert fp8_tokens == ref_tokens and all(len(v) == 8 for v in fp8_tokens.values())


def test_worker_quantization_flag_must_match_the_checkpoint(checkpoints: tuple[Path, Path]) -> None:
    from glm5_worker.config import EngineConfig
    from glm5_worker.resolved import resolve

    fp8, dequantized = checkpoints
    assert resolve(EngineConfig(model=str(fp8), quantization="fp8")).model.hidden_size > 0
    assert resolve(EngineConfig(model=str(dequantized), quantization="none")).model.hidden_size > 0
    with pytest.raises(CheckpointError, match=r"--quantization compressed-tensors but the checkpoint at .* is fp8"):
        resolve(EngineConfig(model=str(fp8), quantization="compressed-tensors"))
    with pytest.raises(
        CheckpointError, match=r"--quantization fp8 but the checkpoint at .* is none; use `glm5 quantize"
    ):
        resolve(EngineConfig(model=str(dequantized), quantization="fp8"))
