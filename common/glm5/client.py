"""A small asyncio client for the Worker API (the router speaks the same Generate shape)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from glm5.v1 import common_pb2, worker_pb2, worker_pb2_grpc


def sampling(**kwargs: Any) -> common_pb2.SamplingParams:
    """SamplingParams with only the given fields set (unset ones take the server's defaults)."""
    return common_pb2.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


class WorkerClient:
    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
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
