"""GenerateStream's batching (glm5.serving.serve_multiplexed) and the merge of a request's responses."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from glm5.serving import RequestFailed, merge_response, serve_multiplexed
from glm5.v1 import common_pb2, worker_pb2


def _resp(ids: list[int], text: str, version: int = 0, **kw: object) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        token_ids=ids, text=text, weight_version=version,
        logprobs=[common_pb2.TokenLogprob(token_id=i, logprob=-0.5) for i in ids], **kw,
    )  # fmt: skip


def test_merge_appends_the_next_response() -> None:
    a = _resp([1, 2], "ab", 3, usage=common_pb2.Usage(prompt_tokens=7, completion_tokens=2))
    b = _resp([3], "c", 3, finish_reason=common_pb2.FINISH_REASON_STOP, stop_reason="c",
              usage=common_pb2.Usage(prompt_tokens=7, completion_tokens=3))  # fmt: skip
    assert merge_response(a, b)
    assert list(a.token_ids) == [1, 2, 3] and a.text == "abc" and [x.token_id for x in a.logprobs] == [1, 2, 3]
    assert a.finish_reason == common_pb2.FINISH_REASON_STOP and a.stop_reason == "c"
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (7, 3) and a.weight_version == 3


def test_merge_refuses_across_weight_versions_and_after_the_end() -> None:
    a, b = _resp([1], "a", 1), _resp([2], "b", 2)
    assert not merge_response(a, b)
    assert list(a.token_ids) == [1] and a.text == "a", "left alone"
    done = _resp([1], "a", finish_reason=common_pb2.FINISH_REASON_LENGTH)
    assert not merge_response(done, _resp([2], "b"))
    assert list(done.token_ids) == [1]


def test_a_batch_carries_what_was_ready_together() -> None:
    """Responses ready at once go out in one batch, each request's merged in order; an error or a new weight
    version is never merged into what came before it."""

    async def one(request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        kind = request.prompt
        for i in range(4):
            yield _resp([i], str(i), version=1 if kind == "swap" and i >= 2 else 0)
        if kind == "fail":
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "gone")
        yield _resp([], "", finish_reason=common_pb2.FINISH_REASON_STOP)

    async def requests() -> AsyncIterator[worker_pb2.GenerateStreamRequests]:
        start = worker_pb2.GenerateStreamRequest
        yield worker_pb2.GenerateStreamRequests(requests=[
            start(id=rid, start=worker_pb2.GenerateRequest(prompt=prompt))
            for rid, prompt in ((1, "plain"), (2, "swap"), (3, "fail"))])  # fmt: skip
        await asyncio.sleep(0.05)  # let them all finish before half-closing

    async def go() -> list[worker_pb2.GenerateStreamResponses]:
        return [b async for b in serve_multiplexed(one, requests())]

    batches = asyncio.run(go())
    entries = [e for b in batches for e in b.responses]
    by_id: dict[int, list[worker_pb2.GenerateStreamResponse]] = {}
    for e in entries:
        by_id.setdefault(e.id, []).append(e)
    for rid in (1, 2, 3):
        assert [t for e in by_id[rid] for t in e.response.token_ids] == [0, 1, 2, 3]
        assert "".join(e.response.text for e in by_id[rid]) == "0123"
    assert len(batches) < len(entries) < 3 * 5, "one message carried several responses, merged per request"
    assert len(by_id[1]) == 1 and by_id[1][0].response.finish_reason == common_pb2.FINISH_REASON_STOP
    assert [e.response.weight_version for e in by_id[2]][:2] == [0, 1], "versions kept apart"
    assert by_id[3][-1].error_code == grpc.StatusCode.UNAVAILABLE.value[0] and not by_id[3][-1].HasField("response")
    assert len(by_id[3]) == 2


def test_a_batch_stays_far_below_the_message_limit() -> None:
    """Large responses (prompt logprobs of a long prompt, say) are spread over several messages."""
    from glm5.serving import BATCH_BYTES, MESSAGE_LIMIT

    chunk = "x" * (1 << 20)

    async def one(request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        for i in range(10):
            yield _resp([i], chunk, finish_reason=common_pb2.FINISH_REASON_STOP if i == 9 else 0)

    async def requests() -> AsyncIterator[worker_pb2.GenerateStreamRequests]:
        start = worker_pb2.GenerateStreamRequest(id=1, start=worker_pb2.GenerateRequest(prompt="big"))
        yield worker_pb2.GenerateStreamRequests(requests=[start])
        await asyncio.sleep(0.05)

    async def go() -> list[worker_pb2.GenerateStreamResponses]:
        return [b async for b in serve_multiplexed(one, requests())]

    batches = asyncio.run(go())
    assert len(batches) >= 3
    assert max(b.ByteSize() for b in batches) <= BATCH_BYTES + len(chunk) + 1024 < MESSAGE_LIMIT
    assert "".join(e.response.text for b in batches for e in b.responses) == chunk * 10


def test_the_glm5_command_sets_grpc_io_defaults_before_grpc_loads_and_a_user_setting_wins() -> None:
    """grpc reads GRPC_EXPERIMENTS when it is imported: importing glm5_cli sets it first (the iomgr poller,
    docs/benchmarks.md n), without importing grpc on the way; a value the user set, even empty, is kept."""
    import os
    import subprocess
    import sys

    from glm5.grpc_env import IOMGR_EXPERIMENTS

    probe = "import sys, os; import glm5_cli; print('grpc' in sys.modules, repr(os.environ.get('GRPC_EXPERIMENTS')))"
    probe_before = "import sys, os, glm5.grpc_env; print('grpc' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}

    def run(code: str, extra: dict[str, str]) -> str:
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    assert run(probe_before, {}) == "False"  # setting the default never loads grpc first
    assert run(probe, {}).endswith(repr(IOMGR_EXPERIMENTS))
    assert run(probe, {"GRPC_EXPERIMENTS": ""}).endswith("''")
    assert run(probe, {"GRPC_EXPERIMENTS": "-event_engine_client"}).endswith("'-event_engine_client'")


def test_a_second_start_under_an_open_id_fails_alone() -> None:
    """A start whose id is still open on the stream is refused (INVALID_ARGUMENT under that id, as the stream's
    per-request errors are); the request already running under it goes on to its end, every token, and is not
    started twice."""
    started: list[str] = []
    release = asyncio.Event()

    async def one(request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        started.append(request.prompt)
        yield _resp([1], "a")
        await release.wait()  # still running while the duplicate arrives
        yield _resp([2], "b", finish_reason=common_pb2.FINISH_REASON_STOP)

    start, many = worker_pb2.GenerateStreamRequest, worker_pb2.GenerateStreamRequests

    async def requests() -> AsyncIterator[worker_pb2.GenerateStreamRequests]:
        yield many(requests=[start(id=7, start=worker_pb2.GenerateRequest(prompt="first"))])
        await asyncio.sleep(0.05)
        yield many(requests=[start(id=7, start=worker_pb2.GenerateRequest(prompt="second"))])
        await asyncio.sleep(0.05)
        release.set()

    async def go() -> list[worker_pb2.GenerateStreamResponse]:
        return [e async for b in serve_multiplexed(one, requests()) for e in b.responses]

    got = asyncio.run(go())
    errors = [e for e in got if e.error_code]
    assert len(errors) == 1 and errors[0].id == 7
    assert errors[0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "already open" in errors[0].error_message
    tokens = [t for e in got if not e.error_code for t in e.response.token_ids]
    assert tokens == [1, 2] and got[-1].response.finish_reason == common_pb2.FINISH_REASON_STOP
    assert started == ["first"], "the duplicate never ran"


def test_health_list_answers_every_status_without_an_error_log(caplog: pytest.LogCaptureFixture) -> None:
    """grpc.health.v1 List (grpcio-health-checking's asyncio servicer lacks it: every call logged an ERROR
    traceback and failed UNIMPLEMENTED)."""
    from glm5.serving import new_server, start_serving
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def go() -> health_pb2.HealthListResponse:
        server = new_server()
        _, port = await start_serving(server, "glm5.v1.Test", lambda s: None, "127.0.0.1", 0,
                                      service_ready=False)  # fmt: skip
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                reply = await health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=10)
        finally:
            await server.stop(None)
        return reply

    with caplog.at_level(logging.WARNING):
        reply = asyncio.run(go())
    status = health_pb2.HealthCheckResponse
    assert {k: v.status for k, v in reply.statuses.items()} == {"": status.SERVING, "glm5.v1.Test": status.NOT_SERVING}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_grpc_listeners_close_stalled_handshakes_and_cap_connections() -> None:
    """ConnectionLimits on a real server: a connection that never completes its HTTP/2 handshake is closed after
    the handshake timeout; past the cap, a new connection is closed as it is accepted; calls still work after."""
    import socket
    import time

    from glm5.serving import ConnectionLimits, new_server, start_serving
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def closed_after(sock: socket.socket, limit: float) -> float | None:
        start = time.monotonic()
        sock.settimeout(limit)
        try:
            while sock.recv(4096):
                pass
        except TimeoutError:
            return None
        except ConnectionResetError:
            pass
        return time.monotonic() - start

    async def go() -> None:
        server = new_server(limits=ConnectionLimits(handshake_timeout_s=1.0, max_connections=2))
        _, port = await start_serving(server, "glm5.v1.Test", lambda s: None, "127.0.0.1", 0)
        try:
            stalled = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port))
            held = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port))
            await asyncio.sleep(0.2)
            extra = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port))
            refused = await asyncio.to_thread(closed_after, extra, 0.8)
            assert refused is not None, "a connection past the cap stayed open"
            waited = await asyncio.to_thread(closed_after, stalled, 5.0)
            assert waited is not None and waited < 3.0, "a stalled handshake was not closed"
            for s in (stalled, held, extra):
                s.close()
            await asyncio.sleep(0.2)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)

    asyncio.run(go())


def test_connection_limits_name_the_bad_flag() -> None:
    from glm5.errors import ConfigError
    from glm5.serving import ConnectionLimits

    with pytest.raises(ConfigError, match="--grpc-max-connections"):
        ConnectionLimits(max_connections=0)
