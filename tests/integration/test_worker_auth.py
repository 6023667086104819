"""The internal token end to end: a real `glm5 worker` started with --internal-token-env refuses every Worker RPC
and reflection without it (UNAUTHENTICATED), keeps health checks open, and serves the callers that send it: a
`glm5 router` process (a chat request end to end), the TITO gateway, the trainer's weight sync, `glm5 generate`.
A router without the token never takes the worker into rotation."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from glm5.client import WorkerClient, sampling
from glm5.rl.buffer import InProcessBuffer
from glm5.security import INTERNAL_TOKEN_METADATA, Secret
from glm5.v1 import tito_pb2, tito_pb2_grpc, worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.helpers.procs import (
    ADMIN_TOKEN,
    INTERNAL_ENV,
    INTERNAL_TOKEN,
    admin_flags,
    free_port,
    start_router,
    start_worker,
    stop,
    wait_serving,
)

FLAGS = ("--max-model-len", "1024", "--kv-cache-bytes", "32MiB", "--internal-token-env", INTERNAL_ENV)
TOKEN = ((INTERNAL_TOKEN_METADATA, INTERNAL_TOKEN.value),)
LONG = sampling(max_new_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("weights")
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    proc, target = start_worker(tiny_model, *FLAGS, *admin_flags(root), log=log)
    try:
        yield {"target": target, "root": root}
    finally:
        code = stop(proc)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "internal token required" in text and INTERNAL_TOKEN.value not in text  # said, never shown


def _call(stub: worker_pb2_grpc.WorkerStub, name: str, metadata: tuple[tuple[str, str], ...]) -> Any:
    """One call of Worker method `name` with `metadata`, read to its end."""
    kw: dict[str, Any] = {"metadata": metadata, "timeout": 60}
    gen = worker_pb2.GenerateRequest(prompt="hi", sampling=sampling(max_new_tokens=2))
    if name == "Generate":
        return list(stub.Generate(gen, **kw))
    if name == "GenerateStream":
        start = worker_pb2.GenerateStreamRequest(id=1, start=gen)
        return list(stub.GenerateStream(iter([worker_pb2.GenerateStreamRequests(requests=[start])]), **kw))
    if name == "PushWeights":
        return stub.PushWeights(iter([worker_pb2.PushWeightsChunk()]), **kw)
    requests = {
        "Tokenize": worker_pb2.TokenizeRequest(text="hi"),
        "Detokenize": worker_pb2.DetokenizeRequest(token_ids=[1, 2]),
        "GetTokenizer": worker_pb2.GetTokenizerRequest(),
        "GetStats": worker_pb2.GetStatsRequest(),
        "GetModelInfo": worker_pb2.GetModelInfoRequest(),
        "UpdateWeights": worker_pb2.UpdateWeightsRequest(version=9, location="missing"),
        "SyncWeights": worker_pb2.SyncWeightsRequest(version=9, rendezvous="127.0.0.1:1", group="g", world_size=2),
    }
    return getattr(stub, name)(requests[name], **kw)


def _reflect(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=30))
    return {s.name for s in reply.list_services_response.service}


METHODS = [m.name for m in worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods]
WRONG = [
    (),  # nothing
    ((INTERNAL_TOKEN_METADATA, "wrong-token"),),
    ((INTERNAL_TOKEN_METADATA, INTERNAL_TOKEN.value + "x"),),
    (("authorization", f"Bearer {INTERNAL_TOKEN.value}"),),  # the right value under another name
    (("x-glm5-admin-token", ADMIN_TOKEN.value),),  # the admin token is not the internal one
]


@pytest.mark.parametrize("metadata", WRONG, ids=["none", "wrong", "longer", "bearer", "admin"])
def test_every_worker_rpc_and_reflection_need_the_token(worker: dict[str, Any], metadata: tuple) -> None:
    assert {"Generate", "GenerateStream", "Tokenize", "GetTokenizer", "GetStats", "GetModelInfo"} <= set(METHODS)
    with grpc.insecure_channel(worker["target"]) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for name in METHODS:
            with pytest.raises(grpc.RpcError) as err:
                _call(stub, name, metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert INTERNAL_TOKEN_METADATA in err.value.details() and INTERNAL_TOKEN.value not in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            _reflect(channel, metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_checks_stay_open_and_the_token_opens_the_rest(worker: dict[str, Any]) -> None:
    with grpc.insecure_channel(worker["target"]) as channel:
        health = health_pb2_grpc.HealthStub(channel)  # the kubelet's probes carry no token
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="glm5.v1.Worker"), timeout=10).status == serving
        listed = health.List(health_pb2.HealthListRequest(), timeout=10).statuses
        assert {k: v.status for k, v in listed.items()} == {"": serving, "glm5.v1.Worker": serving}
        stub = worker_pb2_grpc.WorkerStub(channel)
        assert _call(stub, "GetModelInfo", TOKEN).served_model_name
        assert _call(stub, "Tokenize", TOKEN).token_ids
        assert _call(stub, "GetTokenizer", TOKEN).fingerprint
        assert _call(stub, "GetStats", TOKEN).kv_blocks_total > 0
        assert _call(stub, "Detokenize", TOKEN).text is not None
        assert _call(stub, "Generate", TOKEN)[-1].finish_reason
        assert _call(stub, "GenerateStream", TOKEN)[-1].responses[-1].response.finish_reason
        assert {"glm5.v1.Worker", "grpc.health.v1.Health"} <= _reflect(channel, TOKEN)
        # the admin RPCs keep their own check on top
        for name in ("UpdateWeights", "SyncWeights"):
            with pytest.raises(grpc.RpcError) as err:
                _call(stub, name, TOKEN)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
        with pytest.raises(grpc.RpcError) as err:
            _call(stub, "UpdateWeights", (*TOKEN, ("x-glm5-admin-token", ADMIN_TOKEN.value)))
        assert err.value.code() != grpc.StatusCode.PERMISSION_DENIED  # past both checks: the location is missing


def test_duplicate_request_ids_fail_alone(worker: dict[str, Any]) -> None:
    """A request id already running on the worker is refused for the newcomer (on the same GenerateStream, on
    another call), and the running request goes on to its last token."""
    start, many = worker_pb2.GenerateStreamRequest, worker_pb2.GenerateStreamRequests

    async def go() -> tuple[dict[int, list[worker_pb2.GenerateStreamResponse]], grpc.aio.AioRpcError]:
        async with grpc.aio.insecure_channel(worker["target"]) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            call = stub.GenerateStream(metadata=TOKEN)
            first = worker_pb2.GenerateRequest(request_id="same", prompt="count", sampling=LONG)
            await call.write(many(requests=[start(id=1, start=first)]))
            got: dict[int, list[worker_pb2.GenerateStreamResponse]] = {}
            error: grpc.aio.AioRpcError | None = None
            closing = False
            async for batch in call:
                for msg in batch.responses:
                    got.setdefault(msg.id, []).append(msg)
                if error is None and got.get(1):  # running: the same request id again, twice
                    await call.write(many(requests=[start(id=2, start=first)]))
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in stub.Generate(first, metadata=TOKEN, timeout=30):
                            pass
                    error = err.value
                if not closing and got.get(1) and got[1][-1].response.finish_reason:
                    await call.done_writing()
                    closing = True
            assert error is not None
            return got, error

    got, error = asyncio.run(asyncio.wait_for(go(), 120))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "already running" in (error.details() or "")
    (dup,) = got[2]
    assert dup.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "already running" in dup.error_message
    assert not any(m.error_code for m in got[1])
    assert sum(len(m.response.token_ids) for m in got[1]) == 400, "the first request was not disturbed"


def test_a_router_with_the_token_serves_a_chat_request(worker: dict[str, Any], tmp_path: Path) -> None:
    """... and its own reflection follows its API key, as every call but health checks does."""
    log = tmp_path / "router.log"
    env = {INTERNAL_ENV: INTERNAL_TOKEN.value, "ROUTER_KEY": "key-1"}
    router, grpc_target, base = start_router([worker["target"]], "--internal-token-env", INTERNAL_ENV,
                                             "--api-key-env", "ROUTER_KEY", log=log, env=env)  # fmt: skip
    try:
        wait_serving(grpc_target, proc=router, service="glm5.v1.Router", timeout=60)  # a worker answered it
        client = openai.OpenAI(base_url=base, api_key="key-1", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=6,
                                               messages=[{"role": "user", "content": "1 + 1"}])  # fmt: skip
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        with grpc.insecure_channel(grpc_target) as channel:
            assert "glm5.v1.Router" in _reflect(channel, (("authorization", "Bearer key-1"),))
            for metadata in [(), (("authorization", "Bearer key-2"),), TOKEN]:
                with pytest.raises(grpc.RpcError) as err:
                    _reflect(channel, metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stop(router)
    assert INTERNAL_TOKEN.value not in log.read_text()


def test_a_router_without_the_token_takes_no_worker(worker: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    from glm5_router.config import RouterConfig
    from glm5_router.server.app import start_router as start_router_here

    async def go() -> bool:
        app = await start_router_here(RouterConfig(workers=(worker["target"],), grpc_port=free_port(),
                                                   http_port=free_port(), stats_interval_s=0.2))  # fmt: skip
        try:
            return await app.pool.wait_ready(2)
        finally:
            await app.stop(0)

    assert not asyncio.run(go())
    assert "UNAUTHENTICATED" in caplog.text


def test_gateway_and_trainer_send_the_token(worker: dict[str, Any]) -> None:
    from glm5_tito.gateway import GatewayConfig
    from glm5_tito.server import start_gateway
    from glm5_trainer.versions import sync_workers

    target = worker["target"]

    async def turn(token: Secret | None) -> list[tito_pb2.TurnResponse]:
        config = GatewayConfig(engines=(target,), heartbeat_s=0.2, internal_token=token)
        server, gw, port = await start_gateway(config, InProcessBuffer(), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                request = tito_pb2.TurnRequest(rollout_id="r/0", group_id="r", context_token_ids=[5, 6, 7],
                                               sampling=sampling(max_new_tokens=3, ignore_eos=True))  # fmt: skip
                return [r async for r in tito_pb2_grpc.TitoGatewayStub(ch).Turn(request, timeout=60)]
        finally:
            await server.stop(0)
            await gw.close()

    assert sum(len(r.token_ids) for r in asyncio.run(turn(INTERNAL_TOKEN))) == 3
    with pytest.raises(grpc.aio.AioRpcError):  # its engine never answered its heartbeat: no rank to send to
        asyncio.run(turn(None))

    async def info(token: Secret | None) -> worker_pb2.ModelInfo:
        async with WorkerClient(target, internal_token=token) as client:
            return await client.model_info()

    assert asyncio.run(info(INTERNAL_TOKEN)).served_model_name
    missing = worker["root"] / "missing"

    async def sync(token: Secret | None) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sync_workers([target], 9, missing, admin_token=ADMIN_TOKEN, internal_token=token, timeout=30)
        return err.value

    assert asyncio.run(sync(None)).code() == grpc.StatusCode.UNAUTHENTICATED
    passed = asyncio.run(sync(INTERNAL_TOKEN))  # both tokens: refused only for the checkpoint that is not there
    assert passed.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), passed


def test_glm5_generate_sends_the_token_to_a_worker(worker: dict[str, Any]) -> None:
    cmd = [sys.executable, "-m", "glm5_cli", "generate", "--target", worker["target"], "--max-new-tokens", "3", "hi"]
    env = {**os.environ, INTERNAL_ENV: INTERNAL_TOKEN.value}
    ok = subprocess.run([*cmd, "--internal-token-env", INTERNAL_ENV], env=env, capture_output=True, text=True,
                        timeout=120)  # fmt: skip
    assert ok.returncode == 0 and "3 generated tokens" in ok.stderr, ok.stderr
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
