"""Quantized checkpoints whose sizes are not multiples of their FP8 blocks or INT4 groups, against transformers'
GlmMoeDsaForCausalLM on the same weights dequantized independently of our code (longhand, or by the
compressed-tensors library): the log-probs of an odd-length prompt, prefilled and then decoded through the
cache, within 1e-4, on one device, over two ranks and through the engine.

hidden_size 192 and moe_intermediate_size 160 leave 128 x 128 blocks partial everywhere: an expert's gate is one
whole and one 32-row block and its up half starts a block of its own, down_proj's second column block holds 32
columns. compressed-tensors' group format needs whole groups (its library refuses others), so INT4 groups
divide the sizes without dividing 128; channel scales run on a hidden size that is not a multiple of 8 (each
row's last packed word is partial), and a hand-written checkpoint has a partial last group. Under tensor
parallelism a split dimension is cut into equal shards, which land on block boundaries only when the shard
size is a multiple of the block: such splits are checked against transformers, the others must be refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from glm5.errors import CheckpointError
from glm5.model.loader import load_model
from glm5.model.model import GlmMoeDsaForCausalLM
from glm5.model.quant import FP8, Fp8Linear
from glm5.parallel import TensorParallel
from glm5.quantize.quantizer import quantize_checkpoint
from glm5.quantize.recipe import Recipe, load_recipe
from safetensors.torch import load_file, save_file

from tests.helpers.oracle import SimpleRunner, hf_checkpoint, prompt_ids
from tests.helpers.ranks import run_ranks
from tests.unit.model.test_fp8 import dequant_blocks

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

from tests.helpers.compressed import (  # noqa: E402
    NOT_LINEAR,
    fp8_scheme,
    int4_channel_scheme,
    int4_scheme,
    write_compressed,
    write_decompressed,
)

pytestmark = pytest.mark.oracle

PROMPT, DECODES = 33, 4  # 37 tokens, three times index_topk: the indexer really drops tokens
TOLERANCE = 1e-4
LAYERS = dict(num_hidden_layers=3, index_topk_pattern="FFS", index_topk=12, first_k_dense_replace=1, n_group=2,
              topk_group=1)  # fmt: skip
# 128 x 128 blocks partial in every quantized matrix; q_lora_rank 64 so INT4 groups of 32 fit the attention inputs
ODD = dict(hidden_size=192, moe_intermediate_size=160, intermediate_size=224, q_lora_rank=64, **LAYERS)
# 16 x 16 blocks and groups of 40 partial along the hidden size (never split), whole in every split shard
ODD_SPLIT = dict(hidden_size=200, moe_intermediate_size=160, intermediate_size=320, q_lora_rank=64, **LAYERS)
# channel scales: 196 columns end in a half-full packed word; experts wider than the hidden size
CHANNEL = dict(hidden_size=196, moe_intermediate_size=240, intermediate_size=224, q_lora_rank=64, **LAYERS)
EXPERTS = r"re:.*mlp\.experts\..*"
MLPS = r"re:.*mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj$"

Writer = Callable[[Path, Path], Path]


@dataclass(frozen=True)
class Case:
    config: dict[str, Any]
    write: Writer  # float checkpoint -> the quantized one at `out`
    reference: Writer  # quantized checkpoint -> its float twin at `out`, dequantized without glm5's code


def _recipe(scheme: str, **changes: Any) -> Recipe:
    return replace(load_recipe(scheme, None), **changes)


def _quantized(recipe: Recipe) -> Writer:
    def write(src: Path, out: Path) -> Path:
        quantize_checkpoint(src, out, recipe, progress=False, log=lambda _: None)
        return out

    return write


def _library(schemes: list[Any]) -> Writer:
    return lambda src, out: write_compressed(src, out, schemes)


def fp8_longhand(src: Path, out: Path) -> Path:
    """The float twin of a `quant_method: fp8` checkpoint, block by block (tests/unit/model/test_fp8.py)."""
    config = json.loads((src / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    tensors = load_file(str(src / "model.safetensors"))
    plain = {n: dequant_blocks(t, tensors[n + "_scale_inv"], block) if t.dtype == FP8 else t
             for n, t in tensors.items() if not n.endswith("_scale_inv")}  # fmt: skip
    return _save(out, plain, config)


PARTIAL_GROUP = 128


def partial_groups(src: Path, out: Path) -> Path:
    """Routed experts in INT4 groups of 128 over 192 and 160 columns (the last group partial), packed by the
    compressed-tensors library. Its own quantizer refuses partial groups, so the scales are written here."""
    written: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if ".mlp.experts." not in name or NOT_LINEAR.search(name.removesuffix(".weight")):
            written[name] = t
            continue
        module, cols = name.removesuffix(".weight"), t.shape[1]
        groups = torch.nn.functional.pad(t, (0, -cols % PARTIAL_GROUP)).view(t.shape[0], -1, PARTIAL_GROUP)
        scale = (groups.abs().amax(-1) / 7.5).clamp(min=1e-8)
        q = torch.round(t / scale.repeat_interleave(PARTIAL_GROUP, 1)[:, :cols]).clamp(-8, 7)
        written[f"{module}.weight_packed"] = pack_to_int32(q.to(torch.int8), 4)
        written[f"{module}.weight_scale"] = scale
        written[f"{module}.weight_shape"] = torch.tensor(list(t.shape))
    config = json.loads((src / "config.json").read_text())
    qc = QuantizationConfig(config_groups={"group_0": int4_scheme([EXPERTS], PARTIAL_GROUP)}, format="pack-quantized",
                            ignore=["lm_head"], quantization_status="compressed")  # fmt: skip
    config["quantization_config"] = qc.model_dump(exclude_none=True)
    return _save(out, written, config)


def partial_groups_longhand(src: Path, out: Path) -> Path:
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    tensors = load_file(str(src / "model.safetensors"))
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            shape = torch.Size(tensors[module + ".weight_shape"].tolist())
            scale = tensors[module + ".weight_scale"].repeat_interleave(PARTIAL_GROUP, 1)[:, : shape[1]]
            plain[module + ".weight"] = unpack_from_int32(t, 4, shape).float() * scale
        elif not name.endswith((".weight_scale", ".weight_shape")):
            plain[name] = t
    return _save(out, plain, config)


def _save(out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


RTN = dict(calibration=replace(load_recipe("w4a16", None).calibration, method="rtn"))
CASES = {
    # GLM-5-FP8's format as `glm5 quantize` writes it: every linear but the router and weights_proj
    "fp8-block": Case(ODD, _quantized(_recipe("fp8-block")), fp8_longhand),
    "fp8-block-routed-experts": Case(ODD, _quantized(_recipe("fp8-block", include=("*mlp.experts*",))), fp8_longhand),
    # compressed-tensors' float-quantized block format, written and decompressed by the library
    "ct-fp8-block": Case(ODD, _library([fp8_scheme(["Linear"], 128)]), write_decompressed),
    "w4a16-group": Case(ODD, _quantized(_recipe("w4a16", group_size=32, **RTN)), write_decompressed),
    "w4a16-fp8-mix": Case(ODD, _quantized(_recipe("w4a16-fp8-mix", group_size=32, **RTN)), write_decompressed),
    "int4-channel": Case(CHANNEL, _library([int4_channel_scheme(["Linear"])]), write_decompressed),
    "int4-partial-group": Case(ODD, partial_groups, partial_groups_longhand),
    # over two ranks
    "fp8-block16": Case(ODD_SPLIT, _quantized(_recipe("fp8-block", block_size=(16, 16))), fp8_longhand),
    "int4-group40-mlps": Case(ODD_SPLIT, _library([int4_scheme([MLPS], 40)]), write_decompressed),
    "w4a16-fp8-mix-split": Case(
        ODD_SPLIT, _quantized(_recipe("w4a16-fp8-mix", group_size=40, block_size=(16, 16), **RTN)), write_decompressed
    ),
}
SINGLE = ["fp8-block", "fp8-block-routed-experts", "ct-fp8-block", "w4a16-group", "w4a16-fp8-mix", "int4-channel",
          "int4-partial-group"]  # fmt: skip
# (case, expert_parallel): splits into whole blocks or groups (and words) on every rank
SPLIT = [("fp8-block-routed-experts", True), ("fp8-block16", True), ("fp8-block16", False),
         ("int4-group40-mlps", True), ("int4-group40-mlps", False), ("w4a16-fp8-mix-split", True),
         ("w4a16-fp8-mix-split", False), ("int4-channel", True), ("int4-channel", False)]  # fmt: skip


class Checkpoints:
    """Each case's quantized checkpoint and float twin, built on first use (one float model per config)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._floats: dict[str, Path] = {}
        self._built: dict[str, tuple[Path, Path]] = {}

    def __call__(self, name: str) -> tuple[Path, Path]:
        if name not in self._built:
            case = CASES[name]
            key = json.dumps(case.config, sort_keys=True)
            if key not in self._floats:
                self._floats[key] = self.root / f"float-{len(self._floats)}"
                hf_checkpoint(self._floats[key], seed=4, **case.config)
            quantized = case.write(self._floats[key], self.root / name)
            self._built[name] = quantized, case.reference(quantized, self.root / f"{name}-reference")
        return self._built[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("quantized-parity"))


def parity_ids(vocab: int) -> list[int]:
    return prompt_ids(vocab, PROMPT + DECODES, seed=9)


def transformers_logprobs(reference: Path) -> torch.Tensor:
    from transformers import GlmMoeDsaForCausalLM as HF

    hf: Any = HF.from_pretrained(reference, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        logits: torch.Tensor = hf(torch.tensor([parity_ids(hf.config.vocab_size)])).logits[0]
    return logits.log_softmax(-1)


def our_logprobs(model: GlmMoeDsaForCausalLM) -> torch.Tensor:
    """(PROMPT + DECODES, V): a prefill of the prompt, then one decode step per remaining token."""
    ids = parity_ids(model.config.vocab_size)
    runner = SimpleRunner(model, len(ids))
    rows = [runner.prefill(torch.tensor(ids[:PROMPT]))] + [runner.decode(t)[None] for t in ids[PROMPT:]]
    return torch.cat(rows).log_softmax(-1)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item()


@pytest.mark.parametrize("name", SINGLE)
def test_one_device_matches_transformers_on_the_dequantized_weights(checkpoints: Checkpoints, name: str) -> None:
    quantized, reference = checkpoints(name)
    model = load_model(quantized)
    assert any(p.dtype in (FP8, torch.int32) for p in model.parameters())  # really read as stored
    assert _error(our_logprobs(model), transformers_logprobs(reference)) <= TOLERANCE


def test_fp8_routed_experts_hold_partial_blocks(checkpoints: Checkpoints) -> None:
    """The shapes the parity above runs on: gate and up each own two row blocks (128 + 32 rows), down_proj two
    column blocks (128 + 32 columns), and the rest of the model is float."""
    model = load_model(checkpoints("fp8-block-routed-experts")[0])
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.gate_up_proj.shape == (8, 320, 192)
    assert experts.gate_up_proj_scale_inv.shape == (8, 4, 2) and experts.down_proj_scale_inv.shape == (8, 2, 2)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())


def _ranks(rank: int, world: int, runs: list[tuple[str, str, bool]]) -> dict[str, torch.Tensor]:
    return {key: our_logprobs(load_model(path, tp=TensorParallel(rank, world, ep))) for key, path, ep in runs}


@pytest.fixture(scope="module")
def two_ranks(checkpoints: Checkpoints) -> dict[str, torch.Tensor]:
    """Every split case's log-probs on rank 0 of two (one pair of processes for all of them)."""
    runs = [(f"{name}-{ep}", str(checkpoints(name)[0]), ep) for name, ep in SPLIT]
    out: dict[str, torch.Tensor] = run_ranks(_ranks, 2, runs)[0]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "expert_parallel"), SPLIT, ids=[f"{n}-{'ep' if e else 'split'}" for n, e in SPLIT])
def test_two_ranks_match_transformers_on_the_dequantized_weights(
    checkpoints: Checkpoints, two_ranks: dict[str, torch.Tensor], name: str, expert_parallel: bool
) -> None:
    got = two_ranks[f"{name}-{expert_parallel}"]
    assert _error(got, transformers_logprobs(checkpoints(name)[1])) <= TOLERANCE


# (case, expert_parallel, the error): equal shards that start or end inside a block or group
REFUSED = [
    # the dense MLP's 224 intermediate columns split 112 / 112 inside the first 128-column block
    ("fp8-block", True, r"mlp\.down_proj\.weight_scale_inv: rank 1's columns \[112, 224\) of 224 cut its"),
    # an expert's 160 intermediate rows or columns split 80 / 80
    ("fp8-block-routed-experts", False, r"experts\.0\.\w+_proj\.weight_scale_inv: rank 1's \w+ \[80, 160\) of 160"),
    ("w4a16-group", True, r"mlp\.down_proj\.weight_scale: rank 1's columns \[112, 224\) of 224 cut its"),
]


@pytest.mark.parametrize(("name", "expert_parallel", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_splits_that_cut_a_block_or_group_are_refused(
    checkpoints: Checkpoints, name: str, expert_parallel: bool, message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        load_model(checkpoints(name)[0], tp=TensorParallel(1, 2, expert_parallel))


def test_engine_prompt_logprobs_match_transformers(checkpoints: Checkpoints) -> None:
    """The engine as `glm5 worker --dtype float32 --enforce-eager` runs it: the log-prob of each prompt token
    (dense warm-up off: transformers attends sparsely from the first token)."""
    from glm5.tokenizer.build import write_tokenizer
    from glm5_worker.config import EngineConfig
    from glm5_worker.engine.engine import Engine
    from glm5_worker.engine.sequence import SamplingParams

    quantized, reference = checkpoints("fp8-block")
    write_tokenizer(quantized)
    config = EngineConfig(model=str(quantized), dtype="float32", enforce_eager=True, dense_warmup_tokens=0,
                          max_model_len=256, kv_cache_bytes=8 << 20, block_size=16)  # fmt: skip
    engine = Engine(config)
    ids = parity_ids(engine.model_config.vocab_size)
    engine.add_request("r", None, ids, SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=True))
    got: list[float] = []
    while engine.has_work:
        for out in engine.step():
            got += [p.logprob for p in out.prompt_logprobs]
    want = transformers_logprobs(reference)
    assert len(got) == len(ids) - 1
    assert max(abs(g - want[i, ids[i + 1]].item()) for i, g in enumerate(got)) <= TOLERANCE
