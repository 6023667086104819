"""compressed-tensors checkpoints (the community GLM-5 W4A16 and INT4 + FP8 formats), written here with the
compressed-tensors library's own compressors from a float model: loaded as stored, the logits equal a float model
built from the library's own decompression, on one device and over two ranks; broken checkpoints fail naming the
tensor; bfloat16 on a CPU runs PyTorch's int4 matmul."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from glm5.errors import CheckpointError
from glm5.model.loader import load_model
from glm5.model.quant import FP8, Fp8Linear, Int4Linear, pack_int4, unpack_int4
from glm5.parallel import TensorParallel

from tests.helpers.oracle import engine_greedy, hf_checkpoint, rewrite_checkpoint, step_logits
from tests.helpers.ranks import run_ranks

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402

from tests.helpers.compressed import fp8_scheme, int4_scheme, write_compressed, write_decompressed  # noqa: E402

CONFIG = dict(num_hidden_layers=3, index_topk_pattern="FFS", index_topk=12, first_k_dense_replace=1, n_group=2,
              topk_group=1)  # fmt: skip
EXPERTS = r"re:.*mlp\.experts\..*"
ATTENTION = r"re:.*self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)$"


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("int4")
    hf_checkpoint(root / "float", seed=5, **CONFIG)
    return root / "float"


@pytest.fixture(scope="module")
def mixed(float_checkpoint: Path) -> tuple[Path, Path]:
    """Routed experts in INT4 (groups of 16), attention projections in block FP8: the mixed checkpoints' layout."""
    root = float_checkpoint.parent
    packed = write_compressed(
        float_checkpoint, root / "mixed", [int4_scheme([EXPERTS], 16), fp8_scheme([ATTENTION], 16)]
    )
    return packed, write_decompressed(packed, root / "mixed-reference")


def test_our_int4_packing_is_the_librarys() -> None:
    values = torch.randint(-8, 8, (24, 72), dtype=torch.int8)
    assert torch.equal(pack_int4(values), pack_to_int32(values, 4))
    assert torch.equal(unpack_int4(pack_to_int32(values, 4), 72), values)
    assert torch.equal(unpack_from_int32(pack_int4(values), 4, torch.Size((24, 72))), values)


def test_mixed_checkpoint_loads_as_stored_and_matches_the_library_decompression(mixed: tuple[Path, Path]) -> None:
    packed, reference = mixed
    model = load_model(packed)
    attn, experts = model.model.layers[0].self_attn, model.model.layers[1].mlp.experts
    assert isinstance(attn.q_b_proj, Fp8Linear) and attn.q_b_proj.weight.dtype == FP8
    assert isinstance(attn.kv_b_proj, torch.nn.Linear)  # not targeted: stays float
    assert experts.int4_group == 16 and experts.gate_up_proj_packed.dtype == torch.int32
    assert model.model.layers[1].mlp.shared_experts.down_proj.weight.dtype == torch.float32
    ref = load_model(reference)
    got, want = step_logits(model), step_logits(ref)
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() <= 1e-4
    assert (got[0].argmax(-1) == want[0].argmax(-1)).all()


def _rank(rank: int, world: int, path: str, expert_parallel: bool) -> list[torch.Tensor]:
    return step_logits(load_model(path, tp=TensorParallel(rank, world, expert_parallel)))


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [True, False], ids=["experts-partitioned", "experts-split"])
def test_int4_over_two_ranks_reads_whole_groups(float_checkpoint: Path, tmp_path: Path, expert_parallel: bool) -> None:
    """Each rank reads its rows or columns of packed words and group scales (an expert's down_proj split by its
    intermediate dimension included); all linears INT4 here, o_proj and down_proj split by columns."""
    packed = write_compressed(float_checkpoint, tmp_path / "w4a16", [int4_scheme(["Linear"], 16)])
    ref = step_logits(load_model(write_decompressed(packed, tmp_path / "ref")))
    got = run_ranks(_rank, 2, str(packed), expert_parallel)[0]
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max().item() <= 1e-4
    # groups of 32: an expert's 32 intermediate columns split 16 / 16 would cut a group in two
    coarse = write_compressed(float_checkpoint, tmp_path / "coarse", [int4_scheme([EXPERTS], 32)])
    with pytest.raises(CheckpointError, match=r"down_proj\.weight_scale: rank 1's columns \[16, 32\) of 32 cut"):
        load_model(coarse, tp=TensorParallel(1, 2, expert_parallel=False))


def test_broken_int4_checkpoints_name_the_tensor(mixed: tuple[Path, Path], tmp_path: Path) -> None:
    packed, _ = mixed
    name = "model.layers.1.mlp.experts.3.down_proj"

    def drop_scale(t: dict[str, torch.Tensor]) -> None:
        del t[name + ".weight_scale"]

    def bad_scale(t: dict[str, torch.Tensor]) -> None:
        t[name + ".weight_scale"] = torch.ones(64, 3)

    def bad_shape(t: dict[str, torch.Tensor]) -> None:
        t[name + ".weight_shape"] = torch.tensor([64, 48])

    def asymmetric(qc: dict[str, Any]) -> None:
        qc["config_groups"]["group_0"]["weights"]["symmetric"] = False

    with pytest.raises(
        CheckpointError, match=re.escape(f"{name}.weight_packed is packed INT4 but {name}.weight_scale is missing")
    ):
        load_model(rewrite_checkpoint(packed, tmp_path / "a", drop_scale))
    with pytest.raises(CheckpointError, match=re.escape(f"{name}.weight_scale has shape (64, 3)")):
        load_model(rewrite_checkpoint(packed, tmp_path / "b", bad_scale))
    with pytest.raises(
        CheckpointError, match=re.escape(f"{name}.weight_shape says (64, 48) but the config needs (64, 32)")
    ):
        load_model(rewrite_checkpoint(packed, tmp_path / "c", bad_shape))
    with pytest.raises(CheckpointError, match="asymmetric int4 packed weights are not supported"):
        load_model(rewrite_checkpoint(packed, tmp_path / "d", lambda t: None, asymmetric))


def test_bfloat16_on_cpu_runs_the_int4_kernel(float_checkpoint: Path, tmp_path: Path) -> None:
    """Groups of 32 and row counts in multiples of 16: the CPU int4 matmul takes the experts and the attention
    projections, and each matches a float32 matmul with the library-decompressed weight to bfloat16 precision.
    (Whole-model bfloat16 logits of this random model move as much between bfloat16 and float32 as between
    kernels, so the check is per layer.)"""
    targets = [EXPERTS, r"re:.*self_attn\.(q_a_proj|kv_a_proj_with_mqa|o_proj)$"]
    packed = write_compressed(float_checkpoint, tmp_path / "w4", [int4_scheme(targets, 32)])
    ref = load_model(write_decompressed(packed, tmp_path / "ref"))
    model = load_model(packed, dtype=torch.bfloat16)
    experts = model.model.layers[1].mlp.experts
    o_proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, Int4Linear) and o_proj.cpu_kernel is not None and experts.cpu_kernels is not None
    assert o_proj.weight_packed.dtype == torch.uint8  # repacked in place: one copy of the 4-bit weights
    torch.manual_seed(0)

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return (got.float() - want).abs().max().item() <= 0.01 * want.abs().max().item()

    x = torch.randn(7, o_proj.in_features, dtype=torch.bfloat16)
    assert close(o_proj(x), x.float() @ ref.model.layers[0].self_attn.o_proj.weight.t())
    assert close(o_proj.dense_weight(torch.float32), ref.model.layers[0].self_attn.o_proj.weight)
    ref_experts = ref.model.layers[1].mlp.experts
    x = torch.randn(3, experts.dims[1], dtype=torch.bfloat16)
    assert close(experts._gate_up(x, 5), x.float() @ ref_experts.gate_up_proj[5].t())
    h = torch.randn(3, experts.dims[0], dtype=torch.bfloat16)
    assert close(experts._down(h, 5), h.float() @ ref_experts.down_proj[5].t())
    assert all(torch.isfinite(t).all() for t in step_logits(model))


def test_engine_serves_an_int4_checkpoint_like_its_decompressed_twin(mixed: tuple[Path, Path]) -> None:
    (q_tokens, q_bytes), (ref_tokens, ref_bytes) = (engine_greedy(path) for path in mixed)
    assert {"int32", "float8_e4m3fn"} <= q_bytes.keys() and "int32" not in ref_bytes
    assert q_tokens == ref_tokens and all(len(v) == 8 for v in q_tokens.values())
