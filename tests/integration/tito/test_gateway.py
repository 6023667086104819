"""The TITO gateway (in this process) over two real `glm5 worker` processes and one with another tokenizer:
multi-turn rollouts stick to their rank, logprobs match the worker's own scoring, bad turns are refused,
finished rollouts reach the buffer as well-formed records."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from glm5.client import sampling
from glm5.model.presets import init_model
from glm5.rl.buffer import InProcessBuffer
from glm5.rl.samples import problems
from glm5.v1 import tito_pb2, tito_pb2_grpc, worker_pb2, worker_pb2_grpc
from glm5_tito.gateway import GatewayConfig
from glm5_tito.server import start_gateway

from tests.helpers.procs import start_worker, stop

pytestmark = pytest.mark.asyncio
FLAGS = ("--max-model-len", "2048", "--kv-cache-bytes", "64MiB")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, object]]:
    other = init_model(tmp_path_factory.mktemp("other") / "tok2", preset="tiny", seed=2)  # another tokenizer
    procs = [start_worker(tiny_model, *FLAGS), start_worker(tiny_model, *FLAGS), start_worker(other, *FLAGS)]
    buffer = InProcessBuffer()
    config = GatewayConfig(engines=tuple(t for _, t in procs), heartbeat_s=0.5)
    async with grpc.aio.insecure_channel(procs[0][1]) as ch:  # the job's fingerprint: the tiny model's
        fp = (await worker_pb2_grpc.WorkerStub(ch).GetModelInfo(worker_pb2.GetModelInfoRequest())).tokenizer_fingerprint
    config = GatewayConfig(engines=config.engines, tokenizer_fingerprint=fp, heartbeat_s=0.5)
    server, gw, port = await start_gateway(config, buffer, "127.0.0.1", 0)
    try:
        yield {"target": f"127.0.0.1:{port}", "buffer": buffer, "workers": [t for _, t in procs], "gw": gw}
    finally:
        await server.stop(1)
        await gw.close()
        for p, _ in procs:
            stop(p)


async def _turn(stub: tito_pb2_grpc.TitoGatewayStub, rid: str, group: str, context: list[int],
                n: int = 6) -> list[tito_pb2.TurnResponse]:  # fmt: skip
    req = tito_pb2.TurnRequest(rollout_id=rid, group_id=group, context_token_ids=context,
                               sampling=sampling(max_new_tokens=n, ignore_eos=True, seed=1))  # fmt: skip
    return [r async for r in stub.Turn(req, timeout=120)]


@pytest.mark.asyncio(loop_scope="module")
async def test_multi_turn_rollouts_stick_and_records_are_exact(gateway: dict[str, object]) -> None:
    target, buffer = str(gateway["target"]), gateway["buffer"]
    assert isinstance(buffer, InProcessBuffer)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = tito_pb2_grpc.TitoGatewayStub(ch)
        routing = await stub.GetRouting(tito_pb2.GetRoutingRequest())
        excluded = [r for r in routing.ranks if r.excluded]
        assert len(excluded) == 1 and "fingerprint" in excluded[0].excluded  # the other tokenizer is refused
        rollouts = [f"g1/s{i}" for i in range(6)]
        contexts = {rid: [5, 6, 7, 8 + i] for i, rid in enumerate(rollouts)}
        ranks: dict[str, set[str]] = {rid: set() for rid in rollouts}
        for turn in range(3):
            results = await asyncio.gather(*(_turn(stub, rid, "g1", contexts[rid]) for rid in rollouts))
            for rid, resps in zip(rollouts, results, strict=True):
                gen = [t for r in resps for t in r.token_ids]
                assert len(gen) == 6 and all(len(r.logprobs) == len(r.token_ids) for r in resps)
                ranks[rid] |= {r.rank for r in resps}
                contexts[rid] = contexts[rid] + gen + [100 + turn]  # model tokens, then a tool result
        assert all(len(r) == 1 for r in ranks.values())  # every rollout stayed on its rank for all its turns
        assert len({next(iter(r)) for r in ranks.values()}) == 2  # the group spread over both good ranks

        # A turn that does not extend the ledger is refused, naming the position.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _turn(stub, rollouts[0], "g1", [5, 6, 99])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "position 2" in (err.value.details() or "")

        record = await stub.FinishRollout(tito_pb2.FinishRolloutRequest(
            rollout_id=rollouts[0], reward=1.0, status=tito_pb2.ROLLOUT_STATUS_COMPLETED))  # fmt: skip
        assert not problems(record) and list(record.token_ids) == contexts[rollouts[0]][:-1]
        assert list(record.loss_mask).count(1) == 18 and record.prompt_tokens == 4 and len(record.turn_versions) == 3
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.FinishRollout(tito_pb2.FinishRolloutRequest(rollout_id="nope", status=1))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        (buffered,) = await buffer.take(10, timeout=1)
        assert buffered == record

        # The rollout logprobs are the worker's own scoring of those tokens (prompt logprobs, same weights).
        async with grpc.aio.insecure_channel(next(iter(ranks[rollouts[0]]))) as wch:
            w = worker_pb2_grpc.WorkerStub(wch)
            scored = [r async for r in w.Generate(worker_pb2.GenerateRequest(
                prompt_token_ids=record.token_ids, return_prompt_logprobs=True,
                sampling=sampling(max_new_tokens=1)))]  # fmt: skip
        recomputed = [lp.logprob for lp in scored[0].prompt_logprobs]  # for tokens 1..n-1
        for i, (m, lp) in enumerate(zip(record.loss_mask, record.logprobs, strict=True)):
            if m:
                assert abs(recomputed[i - 1] - lp) < 1e-3, (i, recomputed[i - 1], lp)


@pytest.mark.asyncio(loop_scope="module")
async def test_stream_interval_sends_whole_turns_and_is_validated(gateway: dict[str, object]) -> None:
    async with grpc.aio.insecure_channel(str(gateway["target"])) as ch:
        stub = tito_pb2_grpc.TitoGatewayStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Turn(tito_pb2.TurnRequest(rollout_id="si/bad", context_token_ids=[5, 6], stream_interval=-2,
                                                 sampling=sampling(max_new_tokens=4))).read()  # fmt: skip
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream_interval" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:  # nothing was opened for the refused turn
            await stub.GetRollout(tito_pb2.GetRolloutRequest(rollout_id="si/bad"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        def request(rid: str, interval: int) -> tito_pb2.TurnRequest:
            return tito_pb2.TurnRequest(rollout_id=rid, group_id="si", context_token_ids=[5, 6, 7],
                                        stream_interval=interval,
                                        sampling=sampling(max_new_tokens=9, ignore_eos=True, seed=4))  # fmt: skip

        each = [r async for r in stub.Turn(request("si/each", 0))]
        whole = [r async for r in stub.Turn(request("si/whole", 9))]
        assert len(whole) == 1 < len(each)
        assert list(whole[0].token_ids) == [t for r in each for t in r.token_ids]
        assert list(whole[0].logprobs) == pytest.approx([lp for r in each for lp in r.logprobs], abs=1e-5)
        for rid in ("si/each", "si/whole"):
            record = await stub.FinishRollout(tito_pb2.FinishRolloutRequest(
                rollout_id=rid, reward=0.0, status=tito_pb2.ROLLOUT_STATUS_COMPLETED))  # fmt: skip
            assert list(record.loss_mask).count(1) == 9
