"""Small asyncio clients: the Worker API, and Generate against a router or a worker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from glm5.security import NO_TLS, Secret, TlsConfig, channel
from glm5.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc


def sampling(**kwargs: Any) -> common_pb2.SamplingParams:
    """SamplingParams with only the given fields set (unset ones take the server's defaults)."""
    return common_pb2.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


class WorkerClient:
    def __init__(self, target: str, tls: TlsConfig = NO_TLS) -> None:
        self.channel = channel(target, tls)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)  # type: ignore[no-untyped-call]

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
    tried first, and a server that does not have it (UNIMPLEMENTED) is asked as a worker."""

    def __init__(self, target: str, tls: TlsConfig = NO_TLS, api_key: Secret | None = None) -> None:
        self.channel = channel(target, tls)
        self.metadata = (("authorization", f"Bearer {api_key.value}"),) if api_key is not None else ()

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
        worker = worker_pb2_grpc.WorkerStub(self.channel)  # type: ignore[no-untyped-call]
        async for resp in worker.Generate(request, timeout=timeout, metadata=self.metadata):
            yield resp
