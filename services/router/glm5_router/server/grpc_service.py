"""The glm5.v1.Router gRPC service."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import grpc
from glm5.crypto.envelopes import open_message, seal_message
from glm5.crypto.sm4 import EnvelopeError, KeyRing, ReplayGuard
from glm5.errors import CapacityError, DeadlineError, InvalidRequestError, UnavailableError, bounded
from glm5.v1 import router_pb2, router_pb2_grpc, worker_pb2

from glm5_router.frontend import Frontend, GenerateInput, Thinking
from glm5_router.scheduling.dispatcher import WorkerStatusError
from glm5_router.scheduling.job import Lane

log = logging.getLogger(__name__)
Claim = Callable[[str, float], Awaitable[bool]]  # (key, seconds) -> False when it was already claimed
THINKING: dict[int, Thinking] = {router_pb2.THINKING_MODE_OFF: "off", router_pb2.THINKING_MODE_LIGHT: "light",
                                 router_pb2.THINKING_MODE_DEEP: "deep"}  # fmt: skip
LANES: dict[int, Lane] = {router_pb2.PRIORITY_SHORT: "short", router_pb2.PRIORITY_LONG: "long"}


async def abort_for(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """Typed errors -> gRPC status codes a client can act on."""
    if isinstance(exc, InvalidRequestError | EnvelopeError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(str(exc)))
    if isinstance(exc, WorkerStatusError):
        await context.abort(exc.code, bounded(exc.details))
    if isinstance(exc, CapacityError):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, DeadlineError):
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
    if isinstance(exc, UnavailableError):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    log.exception("unexpected error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
    raise AssertionError("context.abort raises")


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, frontend: Frontend, keys: KeyRing | None, require_sealed: bool = False,
                 replay_window_s: float = 300.0, claim: Claim | None = None,
                 replay_skew_s: float | None = None) -> None:  # fmt: skip
        self.frontend = frontend
        self.keys = keys
        self.require_sealed = require_sealed
        self.guard = ReplayGuard(replay_window_s, skew_s=replay_skew_s)
        # with router replicas sharing Redis, a sealed request id is claimed there too: a replay to another
        # replica is refused as well
        self.claim = claim

    async def Generate(
        self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        sealed = request.HasField("sealed")
        try:
            if self.require_sealed and not sealed:
                raise InvalidRequestError("sealed", "this router serves only SM4-sealed requests (--require-sealed)")
            base = self._open(request) if sealed else request.request
            if sealed and self.claim is not None:
                key = f"{request.sealed.key_id}:{request.request_id}"
                if not await self.claim(key, self.guard.hold_s(request.sealed.issued_at_ms)):
                    raise EnvelopeError(f"request id {request.request_id!r} was already served (by another router "
                                        "replica): a replayed envelope is refused")  # fmt: skip
            self.frontend.check_model(request.model)
            remaining = context.time_remaining()
            inp = GenerateInput(
                base=base, request_id=request.request_id or base.request_id,
                prompt=base.prompt or None, prompt_token_ids=list(base.prompt_token_ids) or None,
                thinking=THINKING.get(request.thinking), session_id=request.session_id or None,
                lane=LANES.get(request.priority), timeout_s=remaining,
            )  # fmt: skip
            if request.chat:
                if not base.prompt:
                    raise InvalidRequestError("chat", "needs a text prompt")
                inp.messages, inp.prompt = [{"role": "user", "content": base.prompt}], None
            job, in_reasoning, _ = await self.frontend.build_async(inp)
            sequence = 0
            async for d in self.frontend.stream(job, in_reasoning, None, inp.session_id):
                out = router_pb2.RouterGenerateResponse(
                    response=d.response, reasoning_delta=d.reasoning, content_delta=d.content, worker=job.worker
                )
                if sealed:
                    assert self.keys is not None
                    sequence += 1
                    out = router_pb2.RouterGenerateResponse(
                        sealed=seal_message(self.keys, out, inp.request_id, sequence)
                    )
                yield out
        except Exception as exc:
            await abort_for(context, exc)

    def _open(self, request: router_pb2.RouterGenerateRequest) -> worker_pb2.GenerateRequest:
        if self.keys is None:
            raise InvalidRequestError("sealed", "this router has no SM4 keys (--sm4-key-dir); send plain requests")
        if not request.request_id:
            raise InvalidRequestError("request_id", "required with a sealed request (it is the associated data)")
        if request.HasField("request"):
            raise InvalidRequestError("request", "give either request or sealed, not both")
        return open_message(self.keys, request.sealed, worker_pb2.GenerateRequest, request.request_id, self.guard)

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        info = self.frontend.pool.model_info
        if info is None:
            await abort_for(context, UnavailableError("no worker has answered yet; retry in a moment"))
        model = worker_pb2.ModelInfo()
        model.CopyFrom(info)
        model.served_model_name = self.frontend.model_name
        return router_pb2.ListModelsResponse(models=[model])
