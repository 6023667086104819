"""What rank 0 of a multi-pod replica forwards of a pushed checkpoint to another host's rank
(glm5_worker.runner.weights.forward_plan): exactly the parts of each tensor that rank's shard reads, so the shard
it builds from them equals the one it would load from the files, for float, FP8-block and INT4 checkpoints,
split by tensor or by expert. The bytes' trip over gloo is tests/integration/test_weight_sync.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from glm5.errors import CheckpointError
from glm5.model.config import ModelConfig
from glm5.model.loader import build_model, checkpoint_files, load_model, shard_reads
from glm5.model.quant import QuantConfig
from glm5.parallel import TensorParallel
from glm5.weight_sync import Manifest, Received, box_of, decode_needs, encode_needs, segments, sent_shape
from glm5_worker.runner.weights import forward_plan

from tests.unit.model.test_quantized_parity import Checkpoints

CASES = [("fp8-block16", True), ("fp8-block16", False), ("int4-group40-mlps", False), ("w4a16-fp8-mix-split", True)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("forward"))


def _forwarded(path: Path, tp: TensorParallel, bucket_bytes: int) -> tuple[int, torch.nn.Module]:
    """The shard rank `tp.rank` builds from what it asks rank 0 for (as glm5_worker.runner.weights.
    receive_checkpoint asks; the bytes cut as glm5.weight_sync.send cuts them, without the network); also the
    bytes it asked for."""
    config = ModelConfig.from_file(path)
    plan, buckets = forward_plan(path, 7, bucket_bytes)
    manifest = Manifest.from_bytes(plan.to_bytes())
    assert manifest == plan and len(manifest.buckets) > 1
    specs = [t for b in manifest.buckets for t in b]
    quant = QuantConfig.from_config(manifest.quant)
    reads = shard_reads(config, ((t.name, t) for t in specs), manifest.dtypes(), torch.float32, quant=quant, tp=tp)
    needs = decode_needs(encode_needs([box_of(reads[t.name], t.shape) if t.name in reads else None for t in specs]),
                         manifest)  # fmt: skip
    asked = sum(sum(segments(b, 1, n)[1]) for b, n in zip(manifest.buckets, needs, strict=True))

    def received() -> object:
        for bucket, k_needs, sources in zip(manifest.buckets, needs, buckets, strict=True):
            for spec, need, source in zip(bucket, k_needs, sources, strict=True):
                if need is not None:
                    part = source.read(tuple(slice(a, b) for a, b in need))
                    assert tuple(part.shape) == sent_shape(spec, need)
                    yield spec.name, Received(part, spec.shape, need)

    model = build_model(config, received(), manifest.dtypes(), torch.float32, tp=tp, quant=quant)  # type: ignore[arg-type]
    return asked, model


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    want = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    got = {**dict(a.named_parameters()), **dict(a.named_buffers())}
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def _file_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in checkpoint_files(path))


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_gets_only_its_parts_of_a_float_checkpoint(tiny_model: Path, world: int) -> None:
    sent = []
    for rank in range(world):
        tp = TensorParallel(rank, world)
        asked, model = _forwarded(tiny_model, tp, bucket_bytes=256 << 10)
        _same(model, load_model(tiny_model, tp=tp))
        sent.append(asked)
    # what is split (embeddings, lm_head, experts, attention projections) goes 1/world to each rank; norms, the
    # router and the indexer go whole to every rank
    assert max(sent) < 0.75 * _file_bytes(tiny_model) / world * 2 and sum(sent) < 1.6 * _file_bytes(tiny_model)


@pytest.mark.parametrize(("name", "expert_parallel"), CASES, ids=[f"{n}-{'ep' if e else 'split'}" for n, e in CASES])
def test_quantized_shards_built_from_the_forwarded_parts_equal_loading_them(
    checkpoints: Checkpoints, name: str, expert_parallel: bool
) -> None:
    path = checkpoints(name)[0]
    for rank in range(2):
        tp = TensorParallel(rank, 2, expert_parallel)
        asked, model = _forwarded(path, tp, bucket_bytes=64 << 10)
        assert any(p.dtype in (torch.float8_e4m3fn, torch.int32) for p in model.parameters())  # sent as stored
        _same(model, load_model(path, tp=tp))
        assert asked < 0.8 * _file_bytes(path)


def test_a_read_outside_what_was_sent_fails() -> None:
    full = torch.arange(24.0).view(4, 6)
    box = box_of((slice(2, 4),), (4, 6))
    assert box == ((2, 4), (0, 6)) and box_of((), (4, 6)) == ()
    got = Received(full[2:4], (4, 6), box)
    assert got.shape == (4, 6) and torch.equal(got.read((slice(2, 4),)), full[2:4])
    assert torch.equal(got.read((slice(3, 4), slice(1, 3))), full[3:4, 1:3])
    with pytest.raises(CheckpointError, match="only"):
        got.read((slice(1, 3),))
