"""The router's side of Worker.GenerateStream (glm5_router.workers.stream) against an in-process scripted worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from glm5.client import sampling
from glm5.model.presets import default_model_path
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from glm5_router.workers.stream import WorkerStream

from tests.helpers.scripted_worker import ScriptedWorker


def _per_call_only(tok: Tokenizer) -> grpc.aio.Server:
    """A worker from before GenerateStream: its service has no such method (the server answers UNIMPLEMENTED)."""
    worker = ScriptedWorker(tok, None, "old")
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        worker.Generate, request_deserializer=worker_pb2.GenerateRequest.FromString,
        response_serializer=worker_pb2.GenerateResponse.SerializeToString)}  # fmt: skip
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("glm5.v1.Worker", handlers),))
    return server


async def _serve(servicer: Any) -> tuple[grpc.aio.Server, str]:
    if isinstance(servicer, grpc.aio.Server):
        server = servicer
    else:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _request(tok: Tokenizer, prompt: str, n: int = 4) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(prompt_token_ids=tok.encode(prompt), sampling=sampling(max_new_tokens=n))


async def _collect(stream: AsyncIterator[worker_pb2.GenerateResponse]) -> list[worker_pb2.GenerateResponse]:
    return [r async for r in stream]


def _tokens(out: list[worker_pb2.GenerateResponse]) -> list[int]:
    return [t for r in out for t in r.token_ids]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(default_model_path())


def test_concurrent_requests_share_one_stream(tok: Tokenizer) -> None:
    async def go() -> None:
        servicer = ScriptedWorker(tok, None, "w")
        server, target = await _serve(servicer)
        async with grpc.aio.insecure_channel(target) as channel:
            ws = WorkerStream(worker_pb2_grpc.WorkerStub(channel), target)  # type: ignore[no-untyped-call]
            outs = await asyncio.gather(*(_collect(ws.generate(_request(tok, f"hello {i}", 5))) for i in range(6)))
            # the scripted worker streams " token" once per token asked, all at once: chunks that were ready
            # together may arrive as one response, nothing lost or reordered
            one = tok.encode(" token")
            assert [_tokens(out) for out in outs] == [one * 5] * 6
            assert ["".join(r.text for r in out) for out in outs] == [" token" * 5] * 6
            assert all(out[-1].finish_reason and out[-1].usage.completion_tokens == 5 * len(one) for out in outs)
            assert not any(r.finish_reason for out in outs for r in out[:-1])
            assert ws.multiplexed and ws._call is not None, "one stream stays open for the next requests"
            # a failure is the request's own: the stream and the others go on
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _collect(ws.generate(_request(tok, "FAIL_AFTER please", 6)))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "mid-stream" in (err.value.details() or "")
            assert _tokens(await _collect(ws.generate(_request(tok, "again", 3)))) == tok.encode(" token") * 3
        await server.stop(0)

    asyncio.run(go())


def test_leaving_early_cancels_the_request_on_the_worker(tok: Tokenizer) -> None:
    async def go() -> None:
        servicer = ScriptedWorker(tok, None, "w")
        server, target = await _serve(servicer)
        async with grpc.aio.insecure_channel(target) as channel:
            ws = WorkerStream(worker_pb2_grpc.WorkerStub(channel), target)  # type: ignore[no-untyped-call]
            stream = ws.generate(_request(tok, "SLOW and long", 40))
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(100):
                if servicer.running == 0:
                    break
                await asyncio.sleep(0.02)
            assert servicer.running == 0, "the worker stopped the abandoned request"
        await server.stop(0)

    asyncio.run(go())


def test_a_broken_stream_fails_every_open_request_and_the_next_one_reconnects(tok: Tokenizer) -> None:
    async def go() -> None:
        server, target = await _serve(ScriptedWorker(tok, None, "w"))
        port = target.rpartition(":")[2]
        async with grpc.aio.insecure_channel(target) as channel:
            ws = WorkerStream(worker_pb2_grpc.WorkerStub(channel), target)  # type: ignore[no-untyped-call]
            slow = [asyncio.ensure_future(_collect(ws.generate(_request(tok, f"SLOW {i}", 30)))) for i in range(3)]
            await asyncio.sleep(0.3)
            await server.stop(0)
            results = await asyncio.gather(*slow, return_exceptions=True)
            assert all(isinstance(r, grpc.aio.AioRpcError) for r in results), results
            assert {r.code() for r in results} <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
            server2 = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(ScriptedWorker(tok, None, "w2"), server2)  # type: ignore[no-untyped-call]
            server2.add_insecure_port(f"127.0.0.1:{port}")
            await server2.start()
            out: list[worker_pb2.GenerateResponse] = []
            for _ in range(50):  # the channel reconnects with backoff
                try:
                    out = await _collect(ws.generate(_request(tok, "back", 2)))
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
            assert _tokens(out) == tok.encode(" token") * 2 and out[-1].finish_reason
            await server2.stop(0)

    asyncio.run(go())


def test_a_worker_without_generate_stream_gets_one_call_per_request(tok: Tokenizer) -> None:
    async def go() -> None:
        server, target = await _serve(_per_call_only(tok))
        async with grpc.aio.insecure_channel(target) as channel:
            ws = WorkerStream(worker_pb2_grpc.WorkerStub(channel), target)  # type: ignore[no-untyped-call]
            outs = await asyncio.gather(*(_collect(ws.generate(_request(tok, f"x {i}", 3))) for i in range(3)))
            assert [len(o) for o in outs] == [3, 3, 3]
            assert not ws.multiplexed
            assert len(await _collect(ws.generate(_request(tok, "y", 2)))) == 2
        await server.stop(0)

    asyncio.run(go())


def test_drain_ends_the_stream_after_the_open_requests(tok: Tokenizer) -> None:
    async def go() -> None:
        server, target = await _serve(ScriptedWorker(tok, None, "w"))
        async with grpc.aio.insecure_channel(target) as channel:
            ws = WorkerStream(worker_pb2_grpc.WorkerStub(channel), target)  # type: ignore[no-untyped-call]
            pending = asyncio.ensure_future(_collect(ws.generate(_request(tok, "SLOW", 4))))
            await asyncio.sleep(0.05)
            call = ws._call
            ws.drain()
            assert len(await pending) == 4, "the open request finished"
            for _ in range(100):
                if call.done():
                    break
                await asyncio.sleep(0.02)
            assert call.done() and ws._call is None
        await server.stop(0)

    asyncio.run(go())


class _OneMessagePerToken(worker_pb2_grpc.WorkerServicer):  # type: ignore[misc]
    """Sends every token in its own message (no batching at the worker); the weights change after token 3."""

    async def GenerateStream(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.send_initial_metadata(())
        batch = await request_iterator.__anext__()
        (start,) = batch.requests
        for i in range(1, 7):
            resp = worker_pb2.GenerateResponse(token_ids=[i], text=str(i), weight_version=0 if i <= 3 else 1)
            if i == 6:
                resp.finish_reason = common_pb2.FINISH_REASON_STOP
            yield worker_pb2.GenerateStreamResponses(
                responses=[worker_pb2.GenerateStreamResponse(id=start.id, response=resp)]
            )
        await asyncio.sleep(1)  # keep the stream open: the router holds it for the next requests


def test_responses_that_queued_behind_a_slow_client_go_out_merged(tok: Tokenizer) -> None:
    async def go() -> None:
        server, target = await _serve(_OneMessagePerToken())
        async with grpc.aio.insecure_channel(target) as channel:
            ws = WorkerStream(worker_pb2_grpc.WorkerStub(channel), target)  # type: ignore[no-untyped-call]
            stream = ws.generate(_request(tok, "x", 6))
            out = [await stream.__anext__()]
            await asyncio.sleep(0.3)  # a slow client: the rest arrives meanwhile
            out += [r async for r in stream]
            assert [t for r in out for t in r.token_ids] == [1, 2, 3, 4, 5, 6]
            assert "".join(r.text for r in out) == "123456"
            assert len(out) <= 3, "what queued went out together, one message per weight version"
            for r in out:  # never a message mixing weight versions
                assert all((t <= 3) == (r.weight_version == 0) for t in r.token_ids)
            assert out[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        await server.stop(0)

    asyncio.run(go())
