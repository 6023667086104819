"""A worker's requests multiplexed over one long-lived Worker.GenerateStream.

Setting up a gRPC call per request costs a Python gRPC hop about as much time to the first token as relaying
the whole answer does (docs/benchmarks.md, e); over an open stream a request is one message. Each request gets
an id on the stream; a reader task hands every response to its request's queue. The stream breaking fails
every request open on it with the stream's status, as their own calls would have failed; the next request
opens a new stream. A worker without GenerateStream (UNIMPLEMENTED) is served with one Generate call per
request from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeAlias

import grpc
from glm5.serving import REQUEST_BATCH_BYTES, merge_response
from glm5.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
CODES = {code.value[0]: code for code in grpc.StatusCode}
OPEN_TIMEOUT_S = 10.0  # a worker that answers health checks opens a stream in milliseconds

Item: TypeAlias = "worker_pb2.GenerateStreamResponse | grpc.aio.AioRpcError"


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a Generate call with this status raises: callers handle both paths alike."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _batches(requests: list[worker_pb2.GenerateStreamRequest]) -> list[list[worker_pb2.GenerateStreamRequest]]:
    """Consecutive runs of at most REQUEST_BATCH_BYTES each (a worker refuses messages over its receive limit)."""
    out: list[list[worker_pb2.GenerateStreamRequest]] = []
    size = REQUEST_BATCH_BYTES
    for r in requests:
        n = r.ByteSize()
        if size + n > REQUEST_BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(r)
        size += n
    return out


class WorkerStream:
    def __init__(self, stub: worker_pb2_grpc.WorkerStub, address: str) -> None:
        self.stub = stub
        self.address = address
        self.multiplexed = True  # False once the worker answered UNIMPLEMENTED
        self._call: Any = None  # grpc.aio.StreamStreamCall of the open stream
        self._open: dict[int, tuple[Any, asyncio.Queue[Item]]] = {}
        self._ids = itertools.count(1)
        self._opening = asyncio.Lock()
        # what to write: (stream, message), None meaning done_writing; one writer task drains it, a batch per write
        self._outbox: list[tuple[Any, worker_pb2.GenerateStreamRequest | None]] = []
        self._writer: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._draining = False

    async def generate(self, request: worker_pb2.GenerateRequest) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
        """The request's responses, as Worker.Generate would stream them; failures raise grpc.aio.AioRpcError.
        Leaving the iteration early cancels the request on the worker."""
        queue: asyncio.Queue[Item] = asyncio.Queue()
        rid = next(self._ids)
        call: Any = None
        ended = False
        try:
            if self.multiplexed:
                call = self._call if self._call is not None else await self._stream()
            if call is not None:
                self._open[rid] = (call, queue)
                self._post(call, worker_pb2.GenerateStreamRequest(id=rid, start=request))
            if call is None:
                ended = True
                async for resp in self._single(request):
                    yield resp
                return
            held: Item | None = None  # taken off the queue while merging, not yet handled
            while True:
                item, held = (held if held is not None else await queue.get()), None
                # responses that queued while the client was slower than the worker go out as one message, as
                # Worker.Generate does for its caller: no token waits for it, and a message costs the same
                # CPU whatever it carries
                while not isinstance(item, grpc.aio.AioRpcError) and not item.error_code and not queue.empty():
                    held = queue.get_nowait()
                    if isinstance(held, grpc.aio.AioRpcError) or held.error_code:
                        break
                    if not merge_response(item.response, held.response):
                        break
                    held = None
                if isinstance(item, grpc.aio.AioRpcError):
                    ended = True
                    if item.code() == grpc.StatusCode.UNIMPLEMENTED:  # the request never ran: send it on its own
                        self.multiplexed = False
                        async for resp in self._single(request):
                            yield resp
                        return
                    raise item
                if item.error_code:
                    ended = True
                    raise rpc_error(CODES.get(item.error_code, grpc.StatusCode.UNKNOWN), item.error_message)
                yield item.response
                if item.response.finish_reason:
                    ended = True
                    return
        finally:
            self._open.pop(rid, None)
            if call is not None and not ended and self._call is call:
                self._post(call, worker_pb2.GenerateStreamRequest(id=rid, cancel=True))
            if call is not None and self._draining and not self._open:
                self._post(call, None)

    def drain(self) -> None:
        """No new requests will come (the worker left the pool): end the stream once the open ones finish."""
        self._draining = True
        if not self._open and self._call is not None:
            self._post(self._call, None)

    async def _stream(self) -> Any:
        async with self._opening:  # requests that come while the stream opens wait for that one
            return await self._open_stream()

    async def _open_stream(self) -> Any:
        """The open stream, opened if needed; None when the worker has no GenerateStream. Opening waits for the
        worker's initial metadata: an old worker answers UNIMPLEMENTED there, before any request is written (a
        write racing that answer would turn the status into a local INTERNAL)."""
        if self._call is None and self.multiplexed:
            call = self.stub.GenerateStream()
            try:
                try:  # the worker sends it at once; an old worker ends the call instead
                    await asyncio.wait_for(call.initial_metadata(), OPEN_TIMEOUT_S)
                except TimeoutError:
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"worker {self.address} did not open a request "
                                    f"stream within {OPEN_TIMEOUT_S:.0f} s") from None  # fmt: skip
                code = await call.code() if call.done() else grpc.StatusCode.OK
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("worker %s has no GenerateStream: one call per request", self.address)
                    self.multiplexed = False
                    return None
                if code != grpc.StatusCode.OK:
                    raise rpc_error(code, await call.details())
            except BaseException:
                call.cancel()  # failed or cancelled while connecting: leave no half-open stream behind
                raise
            self._call = call
            self._spawn(self._read(call))
        return self._call

    async def _read(self, call: Any) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"worker {self.address} ended the request stream")
        try:
            async for batch in call:
                for msg in batch.responses:
                    entry = self._open.get(msg.id)
                    if entry is not None:
                        entry[1].put_nowait(msg)
            code = await call.code()  # a stream can end without the iteration raising its status
            if code != grpc.StatusCode.OK:
                error = rpc_error(code, await call.details())
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the router is shutting down")
            raise
        finally:
            if self._call is call:
                self._call = None
            for stream_call, queue in list(self._open.values()):
                if stream_call is call:
                    queue.put_nowait(error)

    def _post(self, call: Any, msg: worker_pb2.GenerateStreamRequest | None) -> None:
        """Queues `msg` for `call` (None: half-close it). The writer task sends everything queued meanwhile in one
        message: a request's start never waits for another's write, and cancelling the request that queued a
        message cannot lose it."""
        self._outbox.append((call, msg))
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        try:
            while self._outbox:
                pending, self._outbox = self._outbox, []
                for call, group in itertools.groupby(pending, key=lambda entry: entry[0]):
                    msgs = [m for _, m in group]
                    requests = [m for m in msgs if m is not None]
                    # a write fails only on a stream that ended, and its reader fails what was open on it with
                    # the stream's status
                    with contextlib.suppress(Exception):
                        for batch in _batches(requests):
                            await call.write(worker_pb2.GenerateStreamRequests(requests=batch))
                        if len(requests) < len(msgs):
                            await call.done_writing()
        finally:
            self._writer = None

    async def _single(self, request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        call = self.stub.Generate(request)
        try:
            async for resp in call:
                yield resp
        finally:
            call.cancel()  # no-op when it finished

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)
