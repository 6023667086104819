"""Small asyncio clients: the Worker API, and Generate against a router or a worker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from glm5.security import NO_TLS, Secret, TlsConfig, channel, internal_metadata
from glm5.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

WORKER_METHODS = tuple(m.name for m in worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods)


def sampling(**kwargs: Any) -> common_pb2.SamplingParams:
    """SamplingParams with only the given fields set (unset ones take the server's defaults)."""
    return common_pb2.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


class _WithMetadata:
    """A stub method that sends `metadata` with every call, ahead of the caller's own."""

    __slots__ = ("call", "metadata")

    def __init__(self, call: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self.call, self.metadata = call, metadata

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self.call(*args, metadata=(*self.metadata, *(metadata or ())), **kwargs)


def worker_stub(ch: grpc.aio.Channel, internal_token: Secret | None = None) -> worker_pb2_grpc.WorkerStub:
    """A Worker stub whose every call carries the deployment's internal token (when there is one). Per-call
    metadata, not a client interceptor: grpc.aio runs an intercepted stream's writes and reads through extra
    tasks and queues, and the router's GenerateStream carries every token."""
    stub = worker_pb2_grpc.WorkerStub(ch)  # type: ignore[no-untyped-call]
    meta = internal_metadata(internal_token)
    if meta:
        for name in WORKER_METHODS:
            setattr(stub, name, _WithMetadata(getattr(stub, name), meta))
    return stub


class WorkerClient:
    def __init__(self, target: str, tls: TlsConfig = NO_TLS, internal_token: Secret | None = None) -> None:
        self.channel = channel(target, tls)
        self.stub = worker_stub(self.channel, internal_token)

    async def __aenter__(self) -> WorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def generate(
        self, request: worker_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout)  # type: ignore[no-any-return]

    async def stats(self) -> worker_pb2.WorkerStats:
        return await self.stub.GetStats(worker_pb2.GetStatsRequest())  # type: ignore[no-any-return]

    async def model_info(self) -> worker_pb2.ModelInfo:
        return await self.stub.GetModelInfo(worker_pb2.GetModelInfoRequest())  # type: ignore[no-any-return]


class GenerateClient:
    """Generate against a router (glm5.v1.Router, what `glm5 serve` exposes) or a worker: the router's API is
    tried first, and a server that does not have it (UNIMPLEMENTED) is asked as a worker (with `internal_token`,
    which only workers are sent)."""

    def __init__(self, target: str, tls: TlsConfig = NO_TLS, api_key: Secret | None = None,
                 internal_token: Secret | None = None) -> None:  # fmt: skip
        self.channel = channel(target, tls)
        self.metadata = (("authorization", f"Bearer {api_key.value}"),) if api_key is not None else ()
        self.internal_token = internal_token

    async def __aenter__(self) -> GenerateClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()

    async def generate(
        self, request: worker_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        router = router_pb2_grpc.RouterStub(self.channel)  # type: ignore[no-untyped-call]
        call = router.Generate(router_pb2.RouterGenerateRequest(request=request), timeout=timeout,
                               metadata=self.metadata)  # fmt: skip
        started = False
        try:
            async for resp in call:
                started = True
                yield resp.response
            return
        except grpc.aio.AioRpcError as exc:
            if started or exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        worker = worker_stub(self.channel, self.internal_token)
        async for resp in worker.Generate(request, timeout=timeout, metadata=self.metadata):
            yield resp

    async def chat(
        self,
        request: worker_pb2.GenerateRequest,
        timeout: float | None = None,
        thinking: router_pb2.ThinkingMode = router_pb2.THINKING_MODE_UNSPECIFIED,
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        """`request.prompt` as one user message in the model's chat template: a router's (`chat` in
        RouterGenerateRequest), with reasoning and content apart; a worker answers UNIMPLEMENTED."""
        router = router_pb2_grpc.RouterStub(self.channel)  # type: ignore[no-untyped-call]
        call = router.Generate(router_pb2.RouterGenerateRequest(request=request, chat=True, thinking=thinking),
                               timeout=timeout, metadata=self.metadata)  # fmt: skip
        async for resp in call:
            yield resp
