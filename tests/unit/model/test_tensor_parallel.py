"""One model over N ranks (real processes, gloo) against the same model on one: logits within 1e-6 in prefill and
token-by-token decode, every rank picking the same top-k tokens, and each rank reading only its slices.

On the CPU both run in float64: a sharded model sums its partial products in another order than one device
does, which in float32 moves logits by up to ~1e-5 (its size depends on the attention path's arithmetic); in
float64 that noise is far below the float32 logits' last bit, so any real difference shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from glm5.errors import ConfigError
from glm5.model.config import ModelConfig
from glm5.model.loader import load_model, weight_bytes
from glm5.parallel import TensorParallel, check_divisible

from tests.helpers.oracle import SimpleRunner, hf_checkpoint
from tests.helpers.ranks import run_ranks

PROMPT, DECODES = 40, 6  # prompt 2.5x index_topk: the indexer really drops tokens
CONFIG = dict(
    index_topk=16, index_n_heads=4, num_hidden_layers=4, index_topk_pattern="FFSF", n_routed_experts=8, n_group=2,
    topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp-ckpt")
    hf_checkpoint(path, seed=5, **CONFIG)
    return path


def _ids(vocab: int) -> list[int]:
    return torch.randint(0, vocab, (PROMPT + DECODES,), generator=torch.Generator().manual_seed(7)).tolist()


def _run(model: torch.nn.Module, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill logits then one decode step per remaining id; every top-k call's (indices, valid); on the CPU."""
    runner = SimpleRunner(model, len(ids))
    logits = [runner.prefill(torch.tensor(ids[:PROMPT])).cpu()]
    for token in ids[PROMPT:]:
        logits.append(runner.decode(token)[None].cpu())
    picks = [torch.where(valid, idx, -1).sort(dim=-1).values.cpu() for idx, valid in runner.kernels.calls]
    return logits, picks


def _rank(
    rank: int, world: int, path: str, expert_parallel: bool, by_gather: bool, device: str = "cpu"
) -> dict[str, Any]:
    import torch.distributed as dist

    tp = TensorParallel(rank, world, expert_parallel, reduce_by_gather=by_gather)
    dtype = torch.float32 if device == "cuda" else torch.float64
    model = load_model(path, dtype=dtype, device=f"cuda:{rank}" if device == "cuda" else "cpu", tp=tp)
    logits, picks = _run(model, _ids(model.config.vocab_size))
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {"logits": logits if rank == 0 else None, "picks": picks, "bytes": weight_bytes(model), "shapes": names,
            "calls": tp.comm.calls, "is_gloo": dist.get_backend() == "gloo"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "expert_parallel", "by_gather"), [(2, True, False), (4, True, True), (2, False, False), (2, True, True)]
)
def test_sharded_model_matches_one_device(checkpoint: Path, world: int, expert_parallel: bool, by_gather: bool) -> None:
    single = load_model(checkpoint, dtype=torch.float64)
    ref_logits, ref_picks = _run(single, _ids(single.config.vocab_size))
    ranks = run_ranks(_rank, world, str(checkpoint), expert_parallel, by_gather)
    for step, (got, want) in enumerate(zip(ranks[0]["logits"], ref_logits, strict=True)):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-6, f"step {step}"
    for r in ranks[1:]:  # identical hidden states -> identical choices, bit for bit
        assert len(r["picks"]) == len(ranks[0]["picks"])
        assert all(torch.equal(a, b) for a, b in zip(r["picks"], ranks[0]["picks"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["picks"], ref_picks, strict=True))
    # each rank holds a shard: heads, vocabulary and experts (or expert slices) split, the rest replicated
    full = weight_bytes(single)
    for r in ranks:
        assert r["bytes"] < full * 0.8
        assert r["shapes"]["model.embed_tokens.weight"][0] == single.config.vocab_size // world
        assert r["shapes"]["model.layers.0.self_attn.q_b_proj.weight"][0] == (
            single.config.num_attention_heads // world * single.config.qk_head_dim
        )
        experts = r["shapes"]["model.layers.1.mlp.experts.gate_up_proj"]
        if expert_parallel:
            assert experts[0] == single.config.n_routed_experts // world
        else:
            assert experts[1] == 2 * single.config.moe_intermediate_size // world
    # 2 all-reduces per layer + the embedding's + the logits' gather, per step
    steps = 1 + DECODES
    assert ranks[0]["calls"] == steps * (2 * single.config.num_hidden_layers + 2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_sharded_model_over_nccl_matches_one_gpu(checkpoint: Path) -> None:
    """The same model over NCCL, one GPU per rank (scripts/device-check runs it where a task has 2+ GPUs)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    single = load_model(checkpoint, device="cuda:0")
    ref_logits, _ = _run(single, _ids(single.config.vocab_size))
    ranks = run_ranks(_rank, 2, str(checkpoint), True, False, "cuda", backend="nccl")
    for got, want in zip(ranks[0]["logits"], ref_logits, strict=True):
        assert (got - want).abs().max().item() <= 1e-4
    assert all(torch.equal(a, b) for a, b in zip(ranks[1]["picks"], ranks[0]["picks"], strict=True))


def test_sizes_that_do_not_divide_are_named() -> None:
    config = ModelConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, n_routed_experts=6, n_group=1, topk_group=1, num_experts_per_tok=2,
        indexer_types=["full", "shared"], mlp_layer_types=["dense", "sparse"],
    )  # fmt: skip
    check_divisible(config, 2, expert_parallel=True)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\)"):
        check_divisible(config, 8, expert_parallel=True)
    with pytest.raises(ConfigError, match=r"n_routed_experts \(6\)"):
        check_divisible(config, 4, expert_parallel=True)
    check_divisible(config, 4, expert_parallel=False)  # experts split by their intermediate size instead
    with pytest.raises(ConfigError, match=r"intermediate_size \(98\)"):
        check_divisible(ModelConfig(**{**_fields(config), "intermediate_size": 98}), 4, expert_parallel=False)


def _fields(config: ModelConfig) -> dict[str, Any]:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}
