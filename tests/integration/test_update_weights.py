"""Worker.UpdateWeights: a new checkpoint swapped in place under load, without a restart or a failed request."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest
from glm5.client import sampling
from glm5.model.presets import init_model
from glm5.security import Secret, admin_metadata
from glm5.v1 import worker_pb2, worker_pb2_grpc

from tests.helpers.procs import ADMIN_TOKEN, admin_flags, start_worker, stop

FLAGS = ("--max-model-len", "2048", "--kv-cache-bytes", "64MiB", "--block-size", "16")
PROMPT = " ".join(f"w{i}" for i in range(60))  # several full KV blocks: the prefix cache gets involved


async def _greedy(target: str, n: int = 12) -> tuple[list[int], set[int]]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        req = worker_pb2.GenerateRequest(
            prompt=PROMPT, sampling=sampling(max_new_tokens=n, temperature=0, ignore_eos=True)
        )
        ids, versions = [], set()
        async for r in stub.Generate(req, timeout=120):
            ids += r.token_ids
            versions.add(r.weight_version)
        return ids, versions


@pytest.mark.parametrize("extra", [(), ("--tensor-parallel-size", "2")], ids=["one-device", "two-ranks"])
def test_update_weights_in_place_under_load(tiny_model: Path, tmp_path: Path, extra: tuple[str, ...]) -> None:
    """With two ranks every rank reads its own shard of the new checkpoint; a checkpoint any rank cannot read
    changes nothing on any rank (the replica keeps serving the old weights)."""
    new_ckpt = init_model(tmp_path / "tiny-seed1", preset="tiny", seed=1)
    other_tokenizer = init_model(tmp_path / "tiny-seed2", preset="tiny", seed=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # RL updates keep the tokenizer
        shutil.copy(tiny_model / name, new_ckpt / name)
    other = init_model(tmp_path / "shallow", preset="tiny-shallow", seed=0)
    proc, target = start_worker(tiny_model, *FLAGS, *extra, *admin_flags(tmp_path))
    ref_proc, ref_target = start_worker(new_ckpt, *FLAGS)  # what the new weights must produce

    async def go() -> None:
        before, v0 = await _greedy(target)  # also leaves the prompt's blocks in the prefix cache
        assert v0 == {0}
        expected, _ = await _greedy(ref_target)
        assert expected != before  # the two checkpoints really differ
        async with grpc.aio.insecure_channel(target) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            long_req = worker_pb2.GenerateRequest(prompt="keep going",
                                                  sampling=sampling(max_new_tokens=400, ignore_eos=True))  # fmt: skip
            stream = stub.Generate(long_req, timeout=300)
            versions: list[int] = []
            async for r in stream:  # wait until the long request is well under way
                versions += [r.weight_version] * len(r.token_ids)
                if len(versions) >= 20:
                    break
            admin = admin_metadata(ADMIN_TOKEN)
            update = stub.UpdateWeights(worker_pb2.UpdateWeightsRequest(version=7, location=str(new_ckpt)),
                                        metadata=admin)  # fmt: skip
            async for r in stream:  # the in-flight request continues through the swap
                versions += [r.weight_version] * len(r.token_ids)
            reply = await update
            assert reply.version == 7 and reply.swap_seconds < reply.load_seconds + 1
            assert len(versions) == 400 and versions == sorted(versions)
            assert versions[0] == 0 and versions[-1] == 7  # tokens tagged with the weights that produced them
            info = await stub.GetModelInfo(worker_pb2.GetModelInfoRequest())
            assert info.weight_version == 7

            bad, denied = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED
            (tmp_path / "escape").symlink_to(tiny_model)
            for version, location, code, message, meta in [
                (7, new_ckpt, bad, "greater", admin),
                (8, tmp_path / "nope", grpc.StatusCode.INVALID_ARGUMENT, "location", admin),
                (8, other, bad, "geometry", admin),
                (8, other_tokenizer, bad, "tokenizer", admin),
                (8, new_ckpt, denied, "not an administrator", ()),  # no token
                (8, new_ckpt, denied, "not an administrator", admin_metadata(Secret("wrong"))),
                (8, tiny_model, denied, "inside the weights root", admin),  # outside the root
                (8, tmp_path / "escape", denied, "inside the weights root", admin),  # a symlink out of it
                (8, f"{tmp_path}/x/../tiny-seed1", denied, "'..'", admin),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.UpdateWeights(worker_pb2.UpdateWeightsRequest(version=version, location=str(location)),
                                             metadata=meta)  # fmt: skip
                assert err.value.code() == code and message in (err.value.details() or "")
            info = await stub.GetModelInfo(worker_pb2.GetModelInfoRequest())
            assert info.weight_version == 7  # nothing refused changed anything
        after, v1 = await _greedy(target)
        assert v1 == {7}
        # Exactly the new checkpoint's output: no KV computed with the old weights was reused from the cache.
        assert after == expected

    try:
        asyncio.run(go())
    finally:
        assert stop(proc) == 0
        stop(ref_proc)


def test_push_weights_streams_a_checkpoint_the_worker_cannot_see(tiny_model: Path, tmp_path: Path) -> None:
    """PushWeights (the operator's transport): the checkpoint lives where the worker cannot read it; its files are
    streamed, checked, swapped in, and the staged copy is gone afterwards. Refused pushes change nothing."""
    from glm5_trainer.versions import sync_workers

    new_ckpt = init_model(tmp_path / "trainer" / "v5", preset="tiny", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, new_ckpt / name)
    root = tmp_path / "worker-root"  # the worker's own (empty) weights root: nothing shared with the trainer
    root.mkdir()
    proc, target = start_worker(tiny_model, *FLAGS, *admin_flags(root))

    async def go() -> None:
        before, _ = await _greedy(target)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the path transport cannot reach it
            await sync_workers([target], 5, new_ckpt, admin_token=ADMIN_TOKEN, transport="path")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:  # nor can a caller without the admin token
            await sync_workers([target], 5, new_ckpt, transport="stream")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with grpc.aio.insecure_channel(target) as ch:  # a damaged stream
            stub = worker_pb2_grpc.WorkerStub(ch)
            damaged = worker_pb2.PushedFile(name="config.json", size=2, sha256="0" * 64)
            header = worker_pb2.PushWeightsHeader(version=5, files=[damaged])
            chunks = [worker_pb2.PushWeightsChunk(header=header), worker_pb2.PushWeightsChunk(data=b"{}")]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PushWeights(iter(chunks), metadata=admin_metadata(ADMIN_TOKEN))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "SHA-256" in (err.value.details() or "")
            assert (await stub.GetModelInfo(worker_pb2.GetModelInfoRequest())).weight_version == 0

        seconds = await sync_workers([target], 5, new_ckpt, admin_token=ADMIN_TOKEN, transport="stream")
        assert set(seconds) == {target}
        after, versions = await _greedy(target)
        assert versions == {5} and after != before
        assert not any((root / ".pushed").iterdir())  # the staged copy was deleted once loaded
        with pytest.raises(grpc.aio.AioRpcError) as err:  # versions still only go up
            await sync_workers([target], 5, new_ckpt, admin_token=ADMIN_TOKEN, transport="stream")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    try:
        asyncio.run(go())
    finally:
        assert stop(proc) == 0
