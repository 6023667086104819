"""Authentication and transport security end to end: a worker serving mutual TLS with an admin identity, a router
that reaches it over mTLS, serves HTTPS and gRPC over TLS and wants API keys, and a sealed-only router that
refuses plain requests, replayed envelopes and envelopes replayed with other routing fields, and whose errors
for a sealed request say nothing of its payload in the clear. Real processes, the official openai client."""

from __future__ import annotations

import asyncio
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import openai
import pytest
from glm5.client import sampling
from glm5.crypto.envelopes import SEALED_ERROR_KEY, open_error, open_stream_message, seal_request
from glm5.crypto.sm4 import KeyRing, StreamOpener
from glm5.security import NO_TLS, TlsConfig, channel
from glm5.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.certs import TestCA
from tests.helpers.procs import start_router, start_worker, stop

WORKER_FLAGS = ("--max-model-len", "512", "--kv-cache-bytes", "16MiB")
KEYS = ("key-old", "key-new")  # two at once: rotation
SM4_KEY = bytes(range(16))


@pytest.fixture(scope="module")
def secured(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("pki")
    ca = TestCA(folder)
    worker_pair, router_pair, trainer_pair = (
        ca.issue("worker", server=True),
        ca.issue("router", server=True),
        ca.issue("trainer"),
    )
    stranger_ca = TestCA(folder / "stranger")
    stranger = stranger_ca.issue("trainer")  # the admin's name, from a CA the worker does not trust
    keys_file = folder / "api-keys"
    keys_file.write_text("\n".join(KEYS) + "\n")
    root = tmp_path_factory.mktemp("weights")
    router_tls = TlsConfig(str(router_pair.cert), str(router_pair.key), str(ca.path))
    worker, target = start_worker(
        tiny_model, *WORKER_FLAGS, *worker_pair.flags(ca.path), "--admin-identity", "trainer",
        "--weights-root", str(root), tls=router_tls,
    )  # fmt: skip
    router, grpc_target, base = start_router(
        [target], *router_pair.flags(ca.path), "--tls-server-name", "worker", "--api-key-file", str(keys_file),
        "--http-tls-cert", str(router_pair.cert), "--http-tls-key", str(router_pair.key),
        tls=TlsConfig(str(trainer_pair.cert), str(trainer_pair.key), str(ca.path), "router"), https_ca=ca.path,
        log=folder / "router.log",
    )  # fmt: skip
    try:
        pairs = {"worker": worker_pair, "router": router_pair, "trainer": trainer_pair, "stranger": stranger}
        yield {"ca": ca, "worker": target, "router_grpc": grpc_target, "base": base, "root": root, "pairs": pairs}
    finally:
        stop(router)
        stop(worker)
    log = (folder / "router.log").read_text()
    assert "API keys required" in log and not any(key in log for key in KEYS)  # no secret in the log


def _tls(s: dict[str, Any], who: str, server_name: str) -> TlsConfig:
    pair = s["pairs"][who]
    return TlsConfig(str(pair.cert), str(pair.key), str(s["ca"].path), server_name)


async def _health(target: str, tls: TlsConfig) -> int:
    async with channel(target, tls) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        return int(reply.status)


def test_worker_serves_mutual_tls_only(secured: dict[str, Any]) -> None:
    target = secured["worker"]
    assert asyncio.run(_health(target, _tls(secured, "router", "worker"))) == health_pb2.HealthCheckResponse.SERVING
    for tls in (NO_TLS,  # plain text to a TLS port: the handshake fails
                TlsConfig(ca=str(secured["ca"].path), server_name="worker"),  # TLS without a client certificate
                _tls(secured, "stranger", "worker")):  # fmt: skip  # a certificate from another CA
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(_health(target, tls))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_update_weights_needs_the_admin_identity(secured: dict[str, Any]) -> None:
    async def update(who: str) -> grpc.aio.AioRpcError:
        async with channel(secured["worker"], _tls(secured, who, "worker")) as ch:
            request = worker_pb2.UpdateWeightsRequest(version=5, location=str(secured["root"] / "missing"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await worker_pb2_grpc.WorkerStub(ch).UpdateWeights(request, timeout=30)
            return err.value

    denied = asyncio.run(update("router"))  # a trusted peer, but not the admin
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED and "not an administrator" in (denied.details() or "")
    allowed = asyncio.run(update("trainer"))  # passes the check; the checkpoint itself does not exist
    assert allowed.code() == grpc.StatusCode.INVALID_ARGUMENT and "location" in (allowed.details() or "")


def test_router_wants_an_api_key_over_https(secured: dict[str, Any]) -> None:
    http = httpx2.Client(verify=ssl.create_default_context(cafile=str(secured["ca"].path)))
    for key in KEYS:  # both keys of a rotation work
        client = openai.OpenAI(base_url=secured["base"], api_key=key, http_client=http, max_retries=0)
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                               messages=[{"role": "user", "content": "1 + 1"}])  # fmt: skip
        assert reply.choices[0].finish_reason in ("stop", "length")
    bad = openai.OpenAI(base_url=secured["base"], api_key="key-wrong", http_client=http, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401 and "API key" in err.value.message
    # probes stay open (the readiness probe and Prometheus carry no key)
    context = ssl.create_default_context(cafile=str(secured["ca"].path))
    health = secured["base"].removesuffix("/v1") + "/health"
    with urllib.request.urlopen(health, context=context, timeout=10) as resp:
        assert resp.status == 200
    with pytest.raises(openai.APIConnectionError):  # plain HTTP to the HTTPS port
        openai.OpenAI(base_url=secured["base"].replace("https:", "http:"), api_key=KEYS[0],
                      max_retries=0).models.list()  # fmt: skip


def test_router_grpc_wants_tls_and_an_api_key(secured: dict[str, Any]) -> None:
    request = router_pb2.RouterGenerateRequest(
        request=worker_pb2.GenerateRequest(prompt="1 + 1", sampling=sampling(max_new_tokens=3, temperature=0))
    )

    async def generate(tls: TlsConfig, key: str | None) -> str:
        meta = (("authorization", f"Bearer {key}"),) if key else ()
        async with channel(secured["router_grpc"], tls) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            return "".join([r.response.text async for r in stub.Generate(request, timeout=60, metadata=meta)])

    tls = TlsConfig(ca=str(secured["ca"].path), server_name="router")  # the router's clients need no certificate
    assert isinstance(asyncio.run(generate(tls, KEYS[1])), str)
    for tls_used, key, code in [(tls, None, grpc.StatusCode.UNAUTHENTICATED),
                                (tls, "key-wrong", grpc.StatusCode.UNAUTHENTICATED),
                                (NO_TLS, KEYS[0], grpc.StatusCode.UNAVAILABLE)]:  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(generate(tls_used, key))
        assert err.value.code() == code
    # health checks need no key (Kubernetes' gRPC probe sends none)
    assert asyncio.run(_health(secured["router_grpc"], tls)) == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def sealed_only(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("sm4")
    (folder / "keys").mkdir()
    (folder / "keys" / "k1").write_text(SM4_KEY.hex())
    worker, target = start_worker(tiny_model, *WORKER_FLAGS)
    router, grpc_target, base = start_router([target], "--sm4-key-dir", str(folder / "keys"), "--require-sealed",
                                             "--replay-window", "60", log=folder / "router.log")  # fmt: skip
    try:
        yield {"grpc": grpc_target, "base": base, "log": folder / "router.log"}
    finally:
        stop(router)
        stop(worker)


async def _send(target: str, req: router_pb2.RouterGenerateRequest) -> list[router_pb2.RouterGenerateResponse]:
    async with grpc.aio.insecure_channel(target) as ch:
        return [r async for r in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=60)]


def _refused(target: str, req: router_pb2.RouterGenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_send(target, req))
    return err.value


def test_sealed_only_router_refuses_plain_and_replayed_requests(sealed_only: dict[str, Any]) -> None:
    ring = KeyRing({"k1": SM4_KEY})
    inner = worker_pb2.GenerateRequest(prompt="1 + 1", sampling=sampling(max_new_tokens=3, temperature=0))
    once = seal_request(ring, router_pb2.RouterGenerateRequest(request=inner), "r-once")
    first = asyncio.run(_send(sealed_only["grpc"], once))
    assert first and all(r.HasField("sealed") for r in first)
    old = seal_request(ring, router_pb2.RouterGenerateRequest(request=inner), "r-old", issued_at_ms=1000)
    for req, message in [
        (once, "already served"),  # replay
        (router_pb2.RouterGenerateRequest(request=inner), "only SM4-sealed"),
        (old, "older"),
    ]:
        err = _refused(sealed_only["grpc"], req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (err.details() or "")
    client = openai.OpenAI(base_url=sealed_only["base"], api_key="none", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "1 + 1"}])
    assert "sealed" in denied.value.message
    assert client.models.list().data  # listing models reveals no payload


def test_a_captured_envelope_with_other_outer_fields_is_refused(sealed_only: dict[str, Any]) -> None:
    """Routing fields are inside the envelope: a copy of a captured request with chat, thinking, session_id,
    priority, model or request changed outside it is refused before the envelope is opened (so the original is
    still served), and the fields inside are the ones that count."""
    ring = KeyRing({"k1": SM4_KEY})
    inner = worker_pb2.GenerateRequest(prompt="1 + 1", sampling=sampling(max_new_tokens=2, temperature=0))
    captured = seal_request(ring, router_pb2.RouterGenerateRequest(request=inner), "r-captured")
    changes: list[dict[str, Any]] = [
        {"chat": True}, {"thinking": router_pb2.THINKING_MODE_DEEP}, {"session_id": "attacker"},
        {"priority": router_pb2.PRIORITY_LONG}, {"model": "glm5-tiny"}, {"request": inner},
    ]  # fmt: skip
    for change in changes:
        tampered = router_pb2.RouterGenerateRequest(**change)
        tampered.MergeFrom(captured)
        err = _refused(sealed_only["grpc"], tampered)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, change
        assert "outside the envelope" in (err.details() or "") and next(iter(change)) in (err.details() or "")

    def prompt_tokens(request_id: str, chat: bool) -> int:
        req = seal_request(ring, router_pb2.RouterGenerateRequest(request=inner, chat=chat), request_id)
        opener = StreamOpener(ring, request_id)
        out = [open_stream_message(opener, r.sealed, router_pb2.RouterGenerateResponse)
               for r in asyncio.run(_send(sealed_only["grpc"], req))]  # fmt: skip
        return out[-1].response.usage.prompt_tokens

    opener = StreamOpener(ring, "r-captured")
    served = [open_stream_message(opener, r.sealed, router_pb2.RouterGenerateResponse)
              for r in asyncio.run(_send(sealed_only["grpc"], captured))]  # fmt: skip
    assert served[-1].response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED  # the original is served
    assert prompt_tokens("r-chat", chat=True) > prompt_tokens("r-raw", chat=False)  # `chat` inside takes effect


def test_errors_of_a_sealed_request_are_sealed(sealed_only: dict[str, Any]) -> None:
    """A sealed bad regex, out-of-vocabulary ids and an unknown model: the status says only that the request failed;
    the reason (which quotes the payload) comes sealed in the trailing metadata, and the payload appears nowhere in
    the clear: not in the status details, the trailing metadata or the router's log."""
    ring = KeyRing({"k1": SM4_KEY})
    marker, oov = "TOP-SECRET-PATTERN(((", 91827364
    bad_regex = worker_pb2.GenerateRequest(prompt="1 + 1", sampling=sampling(
        max_new_tokens=2, structured_output=common_pb2.StructuredOutput(regex=marker)))  # fmt: skip
    cases = [
        (router_pb2.RouterGenerateRequest(request=bad_regex), marker),
        (router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(prompt_token_ids=[5, oov])), str(oov)),
        (router_pb2.RouterGenerateRequest(request=bad_regex, model="model-TOP-SECRET"), "model-TOP-SECRET"),
    ]
    for i, (routed, secret) in enumerate(cases):
        request_id = f"r-bad-{i}"
        err = _refused(sealed_only["grpc"], seal_request(ring, routed, request_id))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        clear = [err.details() or "", err.debug_error_string() or ""]
        clear += [v if isinstance(v, str) else v.decode("latin-1") for _, v in err.trailing_metadata() or ()]
        assert SEALED_ERROR_KEY in clear[0] and not any(secret in text or marker in text for text in clear)
        reason = open_error(StreamOpener(ring, request_id), err.trailing_metadata())
        assert reason is not None and reason.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert secret in reason.message  # the client learns why
    log = sealed_only["log"].read_text()
    assert "router: gRPC on" in log  # the router's own log, INFO and up
    assert marker not in log and str(oov) not in log and "model-TOP-SECRET" not in log


def test_a_replay_to_another_router_replica_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    """Router replicas sharing a Redis queue share the replay window: the same envelope twice, to two replicas."""
    from tests.helpers.procs import start_redis

    (tmp_path / "sm4").mkdir()
    (tmp_path / "sm4" / "k1").write_text(SM4_KEY.hex())
    redis, url = start_redis(tmp_path)
    worker, target = start_worker(tiny_model, *WORKER_FLAGS)
    flags = ("--sm4-key-dir", str(tmp_path / "sm4"), "--redis-url", url)
    routers = [start_router([target], *flags) for _ in range(2)]
    ring = KeyRing({"k1": SM4_KEY})
    inner = worker_pb2.GenerateRequest(prompt="1 + 1", sampling=sampling(max_new_tokens=2, temperature=0))
    request = seal_request(ring, router_pb2.RouterGenerateRequest(request=inner), "r-shared")

    async def send(grpc_target: str) -> int:
        async with grpc.aio.insecure_channel(grpc_target) as ch:
            return len([r async for r in router_pb2_grpc.RouterStub(ch).Generate(request, timeout=60)])

    try:
        assert asyncio.run(send(routers[0][1])) > 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(send(routers[1][1]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "another router replica" in (err.value.details() or "")
    finally:
        for proc, _, _ in routers:
            stop(proc)
        stop(worker)
        redis.kill()
        redis.wait()
