"""Trainer weight versions: actor_latest every step, actor_ema alongside, actor_synced published every K steps
or after the sync interval, pushed to a real worker with UpdateWeights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from glm5.client import sampling
from glm5.model.loader import load_model
from glm5.v1 import worker_pb2, worker_pb2_grpc
from glm5_trainer.versions import WeightVersions, sync_workers

from tests.helpers.procs import ADMIN_TOKEN, admin_flags, start_worker, stop


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))


def test_versions_publish_and_sync(tiny_model: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = load_model(tiny_model)
    clock = Clock()
    v = WeightVersions(model, tmp_path / "out", tiny_model, sync_every_steps=3, sync_interval_s=60, ema_decay=0.5,
                       clock=clock)  # fmt: skip
    published = []
    for _ in range(7):
        _step(model)
        clock.t += 1
        published.append(v.after_step())
    assert [p is not None for p in published] == [False, False, True, False, False, True, False]
    assert (v.latest, v.synced) == (7, 6)
    clock.t += 61  # the interval passes without K steps
    _step(model)
    path = v.after_step()
    assert path is not None and path.name == "v000008" and v.synced == 8
    name = "model.embed_tokens.weight"
    assert not torch.equal(v.ema[name], model.state_dict()[name].float())  # EMA lags the live weights
    for f in ("config.json", "model.safetensors", "tokenizer.json", "version.json"):
        assert (path / f).is_file()
    with pytest.raises(ValueError, match="1800"):
        WeightVersions(model, tmp_path, tiny_model, sync_interval_s=3600)

    flags = ("--max-model-len", "1024", "--kv-cache-bytes", "32MiB", *admin_flags(tmp_path))
    proc, target = start_worker(tiny_model, *flags)
    try:
        times = asyncio.run(sync_workers([target], v.synced, path, admin_token=ADMIN_TOKEN))
        assert set(times) == {target} and times[target] > 0

        async def check() -> int:
            async with grpc.aio.insecure_channel(target) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                req = worker_pb2.GenerateRequest(prompt="1 + 1", sampling=sampling(max_new_tokens=2))
                return {r.weight_version async for r in stub.Generate(req)}.pop()

        assert asyncio.run(check()) == 8  # the worker serves actor_synced v8
    finally:
        stop(proc)
