from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from glm5.errors import CheckpointError, ConfigError
from glm5.model.config import ModelConfig
from glm5.model.loader import load_model, save_checkpoint
from safetensors.torch import load_file, save_file

from tests.helpers.oracle import TINY


def raw_config(**kw) -> dict:
    return {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", **TINY, **kw}


def test_reads_transformers_defaults_and_patterns() -> None:
    from transformers import GlmMoeDsaConfig

    raw = raw_config(num_hidden_layers=6, index_topk_freq=2, index_skip_topk_offset=2)
    c = ModelConfig.from_dict(raw)
    assert (
        c.indexer_types == GlmMoeDsaConfig(**raw).indexer_types == ["full", "full", "shared", "full", "shared", "full"]
    )
    assert c.mlp_layer_types == ["dense"] + ["sparse"] * 5
    assert ModelConfig.from_dict(raw_config(num_hidden_layers=3, index_topk_pattern="FSF")).indexer_types == [
        "full",
        "shared",
        "full",
    ]
    assert c.eos_token_id == [1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(rope_parameters={"rope_type": "yarn", "factor": 3.0}), "power of two"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 6.0}), "power of two"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "not supported"),
        (dict(index_topk_pattern="FXF", num_hidden_layers=3), "only F and S"),
        (dict(index_topk_pattern="SFF", num_hidden_layers=3), "first layer"),
        (dict(n_routed_experts=6, n_group=4), "n_group"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_bad_configs_are_rejected_with_a_reason(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw_config(**overrides))


def test_unknown_architecture() -> None:
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


@pytest.fixture(scope="module")
def saved(tiny_model: Path) -> Path:
    return tiny_model


def test_missing_files(tmp_path: Path, saved: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path / "empty")
    shutil.copy(saved / "config.json", tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path / "empty")


def test_shape_mismatch_names_the_tensor(tmp_path: Path, saved: Path) -> None:
    shutil.copytree(saved, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(tmp_path / "m")


def test_missing_tensor_is_an_error_and_mtp_layers_are_ignored(tmp_path: Path, saved: Path, caplog) -> None:
    shutil.copytree(saved, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    n = json.loads((saved / "config.json").read_text())["num_hidden_layers"]
    mtp = {
        k.replace("model.layers.1.", f"model.layers.{n}."): v.clone() for k, v in tensors.items() if ".layers.1." in k
    }
    save_file({**tensors, **mtp}, tmp_path / "m" / "model.safetensors")
    with caplog.at_level("INFO"):
        load_model(tmp_path / "m")
    assert "multi-token-prediction" in caplog.text
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing 1 tensors: model.norm.weight"):
        load_model(tmp_path / "m")


def test_sharded_roundtrip_and_dtypes(tmp_path: Path, saved: Path) -> None:
    model = load_model(saved)
    save_checkpoint(model, tmp_path / "sharded", max_shard_bytes=1 << 20)
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in index["weight_map"]
    again = load_model(tmp_path / "sharded")
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    bf16 = load_model(saved, dtype=torch.bfloat16)
    assert bf16.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    # kept in float32 like the reference: router bias and indexer head weights
    assert bf16.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert bf16.model.layers[1].self_attn.indexer.weights_proj.weight.dtype == torch.float32


def test_transformers_reads_our_checkpoints(saved: Path) -> None:
    from transformers import GlmMoeDsaForCausalLM

    hf = GlmMoeDsaForCausalLM.from_pretrained(saved)
    ours = load_model(saved)
    assert torch.equal(hf.model.layers[2].mlp.experts.gate_up_proj, ours.model.layers[2].mlp.experts.gate_up_proj)
