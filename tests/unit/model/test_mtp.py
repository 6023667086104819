"""Multi-token-prediction layers (glm5.model.model.MTPLayer, loader `mtp`): loaded from a checkpoint under its
own names, the layer's draft log-probs equal transformers' decoder block computing the same formula (float32,
1e-4) in one prefill and through its own cache rows token by token; a checkpoint that declares MTP layers but
lacks their weights serves without them (one warning) and is an error only when they are required.

transformers has no MTP layer (it ignores a GLM-5 checkpoint's layer 78), so the oracle is built from its parts:
the main model's last hidden state (transformers, N layers), the input projection written out here, then a
one-layer transformers model holding the MTP block, its final norm = shared_head.norm, fed those inputs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from glm5.errors import CheckpointError
from glm5.model.loader import load_model
from glm5.parallel import TensorParallel
from safetensors.torch import load_file, save_file

from tests.helpers.oracle import TINY, SimpleRunner, mtp_checkpoint
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.oracle

# hidden 72 and expert width 40: not multiples of the 16/32 the kernels tile by; 3 decoder layers + 1 MTP layer
SHAPES = dict(hidden_size=72, moe_intermediate_size=40, intermediate_size=104, index_topk=16)
MAIN_LAYERS = 3
SEQ = 61


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("mtp")
    return path, mtp_checkpoint(path, MAIN_LAYERS, seed=3, **SHAPES)


def _oracle(path: Path, tensors: dict[str, torch.Tensor], ids: torch.Tensor, block_dir: Path) -> torch.Tensor:
    """transformers' log-probs of the MTP layer's draft at each position 0..T-2 (the token two ahead)."""
    from transformers import GlmMoeDsaConfig
    from transformers import GlmMoeDsaForCausalLM as HF

    n = MAIN_LAYERS
    main = HF.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = main.model(ids[None]).last_hidden_state[0]  # after the final norm
    cfg = json.loads((path / "config.json").read_text())
    one = {**cfg, "num_hidden_layers": 1, "mlp_layer_types": ["sparse"], "indexer_types": ["full"],
           "layer_types": cfg["layer_types"][:1], "num_nextn_predict_layers": 0}  # fmt: skip
    prefix = f"model.layers.{n}."
    state = {"model.layers.0." + k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight"):
        state.pop("model.layers.0." + k)
    state["model.norm.weight"] = state.pop("model.layers.0.shared_head.norm.weight")
    state |= {k: tensors[k] for k in ("lm_head.weight", "model.embed_tokens.weight")}
    block_dir.mkdir()
    (block_dir / "config.json").write_text(json.dumps(one))
    save_file(state, block_dir / "model.safetensors", metadata={"format": "pt"})
    block = HF.from_pretrained(block_dir, dtype=torch.float32).eval()
    assert isinstance(block.config, GlmMoeDsaConfig) and len(block.model.layers) == 1
    eps = cfg["rms_norm_eps"]
    embeds = tensors["model.embed_tokens.weight"][ids[1:]].clone()
    embeds[0] = 0.0  # the row at position 0 (vLLM's rule; glm5.model.model.mtp_forward)
    w = {k: tensors[prefix + k + ".weight"] for k in ("enorm", "hnorm", "eh_proj")}
    x = torch.cat([_rms(embeds, w["enorm"], eps), _rms(hidden[:-1], w["hnorm"], eps)], dim=-1) @ w["eh_proj"].T
    with torch.no_grad():
        logits = block(inputs_embeds=x[None]).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_mtp_draft_log_probs_match_transformers(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, tensors = checkpoint
    ids = torch.randint(0, TINY["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(5))
    ref = _oracle(path, tensors, ids, tmp_path / "block")
    ours = load_model(path, mtp="require")
    assert len(ours.mtp_layers) == 1 and ours.mtp_layers[0].shared_head.head is None
    # in one prefill
    runner = SimpleRunner(ours, SEQ)
    hidden = runner.prefill_hidden(ids)
    got = torch.log_softmax(runner.mtp(ids[1:], hidden[:-1], 0), dim=-1)
    assert (got - ref).abs().max().item() <= 1e-4
    # the MTP layer's own cache rows: a prefill of the first 20 positions, then one position per decode step
    runner = SimpleRunner(ours, SEQ)
    hidden = runner.prefill_hidden(ids)
    rows = [runner.mtp(ids[1:21], hidden[:20], 0)]
    rows += [runner.mtp(ids[p + 1 : p + 2], hidden[p : p + 1], p, decode=True) for p in range(20, SEQ - 1)]
    got = torch.log_softmax(torch.cat(rows), dim=-1)
    assert (got - ref).abs().max().item() <= 1e-4
    # the main model is unchanged by the layer after it: its logits equal a load without MTP
    plain = SimpleRunner(load_model(path), SEQ).prefill(ids)
    assert torch.equal(SimpleRunner(ours, SEQ).prefill(ids), plain)


def test_mtp_layers_load_only_when_asked_and_missing_weights_are_named(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, tensors = checkpoint
    assert load_model(path).mtp_layers == [] and len(load_model(path, mtp="auto").mtp_layers) == 1
    # declared but absent ("without mtp" quantizations): served without, one warning; required: an error
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    (stripped / "config.json").write_text((path / "config.json").read_text())
    kept = {k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{MAIN_LAYERS}.")}
    save_file(kept, stripped / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="glm5.model.loader"):
        assert load_model(stripped, mtp="auto").mtp_layers == []
    warned = [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(warned) == 1 and "stores weights for 0" in warned[0].getMessage()
    with pytest.raises(
        CheckpointError, match=rf"multi-token-prediction.*model\.layers\.{MAIN_LAYERS}\.eh_proj\.weight"
    ):
        load_model(stripped, mtp="require")
    # a half-written MTP layer is a broken checkpoint, in every mode that reads it
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if not k.endswith(f"{MAIN_LAYERS}.hnorm.weight")},
              broken / "model.safetensors")  # fmt: skip
    with pytest.raises(CheckpointError, match="hnorm"):
        load_model(broken, mtp="auto")
    assert load_model(broken).mtp_layers == []  # skipped: not read
    # no MTP layers declared: asking for them is an error that says so
    config = json.loads((stripped / "config.json").read_text()) | {"num_nextn_predict_layers": 0}
    (stripped / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers is 0"):
        load_model(stripped, mtp="require")


def test_init_model_writes_mtp_layers_in_the_checkpoints_naming(tmp_path: Path) -> None:
    from glm5.model.loader import checkpoint_files, stored_dtypes
    from glm5.model.presets import init_model
    from transformers import GlmMoeDsaForCausalLM as HF

    out = init_model(tmp_path / "m", mtp_layers=1)
    config = json.loads((out / "config.json").read_text())
    n = config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    names = set(stored_dtypes(checkpoint_files(out)))
    wanted = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
              "self_attn.kv_a_proj_with_mqa.weight", "self_attn.indexer.wk.weight",
              "mlp.experts.0.gate_proj.weight")  # fmt: skip
    for tensor in wanted:
        assert f"model.layers.{n}.{tensor}" in names
    assert not any(name.startswith(f"model.layers.{n + 1}.") for name in names)
    model = load_model(out, mtp="require")
    assert len(model.mtp_layers) == 1
    # transformers still reads the checkpoint (the MTP layer is not its model's)
    hf = HF.from_pretrained(out)
    assert len(hf.model.layers) == n


def _tp_rank(rank: int, world: int, path: str, expert_parallel: bool) -> dict[str, Any] | None:
    tp = TensorParallel(rank, world, expert_parallel)
    model = load_model(path, dtype=torch.float64, tp=tp, mtp="require")
    out = _draft(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {"logits": out, "shapes": shapes} if rank == 0 else {"shapes": shapes}


def _draft(model: torch.nn.Module) -> torch.Tensor:
    """MTP logits after a prefill: 30 positions in one step, then 4 decode steps."""
    ids = torch.randint(0, model.config.vocab_size, (36,), generator=torch.Generator().manual_seed(8))
    runner = SimpleRunner(model, 36)
    hidden = runner.prefill_hidden(ids)
    rows = [runner.mtp(ids[1:31], hidden[:30], 0)]
    rows += [runner.mtp(ids[p + 1 : p + 2], hidden[p : p + 1], p, decode=True) for p in range(30, 34)]
    return torch.cat(rows).cpu()


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [True, False])
def test_mtp_layer_under_tensor_parallelism_matches_one_device(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, expert_parallel: bool
) -> None:
    """Sharded like any decoder layer (float64, as test_tensor_parallel says why), here with the layer's own
    LM head (shared_head.head, split by vocabulary rows like lm_head)."""
    path, tensors = checkpoint
    own = tmp_path / "own-head"
    own.mkdir()
    (own / "config.json").write_text((path / "config.json").read_text())
    head = torch.randn(tensors["lm_head.weight"].shape, generator=torch.Generator().manual_seed(9))
    save_file(tensors | {f"model.layers.{MAIN_LAYERS}.shared_head.head.weight": head}, own / "model.safetensors")
    single = load_model(own, dtype=torch.float64, mtp="require")
    assert single.mtp_layers[0].shared_head.head is not None
    want = _draft(single)
    ranks = run_ranks(_tp_rank, 2, str(own), expert_parallel)
    assert (ranks[0]["logits"] - want).abs().max().item() <= 1e-6
    n, vocab = MAIN_LAYERS, single.config.vocab_size
    for r in ranks:
        assert r["shapes"][f"model.layers.{n}.shared_head.head.weight"][0] == vocab // 2
        experts = r["shapes"][f"model.layers.{n}.mlp.experts.gate_up_proj"]
        assert experts[0] == (
            single.config.n_routed_experts // 2 if expert_parallel else single.config.n_routed_experts
        )
        assert r["shapes"][f"model.layers.{n}.eh_proj.weight"] == (
            single.config.hidden_size,
            2 * single.config.hidden_size,
        )


def test_block_fp8_mtp_layer_matches_transformers_on_the_dequantized_weights(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """`glm5 quantize` quantizes the MTP layer's block as GLM-5-FP8 stores it (16 x 16 blocks here, partial along
    hidden 72 and experts 40); the served draft equals transformers' on the weights dequantized longhand."""
    from dataclasses import replace

    from glm5.quantize.quantizer import quantize_checkpoint
    from glm5.quantize.recipe import load_recipe

    from tests.unit.model.test_fp8 import dequant_blocks

    path, _ = checkpoint
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(path, fp8, replace(load_recipe("fp8-block", None), block_size=(16, 16)), progress=False,
                        log=lambda _: None)  # fmt: skip
    stored = load_file(fp8 / "model.safetensors")
    prefix = f"model.layers.{MAIN_LAYERS}."
    quantized = [n for n, t in stored.items() if n.startswith(prefix) and t.dtype == torch.float8_e4m3fn]
    assert any(".mlp.experts." in n for n in quantized) and any(".self_attn." in n for n in quantized)
    assert stored[prefix + "eh_proj.weight"].dtype == torch.float32
    floats = {n: t for n, t in stored.items() if not n.endswith("_scale_inv")}
    for n, t in stored.items():
        if t.dtype == torch.float8_e4m3fn:  # the decoder layers' too
            floats[n] = dequant_blocks(t, stored[n + "_scale_inv"], (16, 16))
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    (dequantized / "config.json").write_text((path / "config.json").read_text())
    save_file(floats, dequantized / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, TINY["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(6))
    ref = _oracle(dequantized, floats, ids, tmp_path / "block")
    ours = load_model(fp8, mtp="require")
    runner = SimpleRunner(ours, SEQ)
    hidden = runner.prefill_hidden(ids)
    got = torch.log_softmax(runner.mtp(ids[1:], hidden[:-1], 0), dim=-1)
    assert (got - ref).abs().max().item() <= 1e-4
