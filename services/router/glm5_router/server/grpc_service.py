"""The glm5.v1.Router gRPC service."""

from __future__ import annotations

import logging
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import grpc
from glm5.crypto.envelopes import OUTER_FIELDS, SEALED_ERROR_KEY, StreamSealer, open_message
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
SEALED_ONLY = "this router serves only SM4-sealed requests (--require-sealed)"
SEALED_FAILURE = f"the sealed request failed; its reason is sealed in the {SEALED_ERROR_KEY} trailing metadata"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """Typed errors -> the gRPC status code a client can act on and its details; None for an unexpected error."""
    if isinstance(exc, InvalidRequestError | EnvelopeError):
        return grpc.StatusCode.INVALID_ARGUMENT, bounded(str(exc))
    if isinstance(exc, WorkerStatusError):
        return exc.code, bounded(exc.details)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, DeadlineError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, UnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return None


async def abort_for(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    status = status_for(exc)
    if status is None:
        log.exception("unexpected error", exc_info=exc)
        status = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
    await context.abort(*status)
    raise AssertionError("context.abort raises")


async def abort_sealed(context: grpc.aio.ServicerContext, exc: BaseException, sealer: StreamSealer) -> NoReturn:
    """A sealed request's failure: the status code in the clear (clients retry on it), generic details, and the
    reason sealed in the trailing metadata. Nothing of it reaches the log either: a reason may quote the payload
    (a pattern, a token id, a model name)."""
    status = status_for(exc)
    if status is None:
        # the traceback without the exception's message, which may quote the payload
        log.error("unexpected error in sealed request %s: %s\n%s", sealer.request_id, type(exc).__name__,
                  "".join(traceback.format_tb(exc.__traceback__)).rstrip())  # fmt: skip
        status = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
    code, details = status
    sealed = sealer.seal_error(code.value[0], details)
    await context.abort(code, SEALED_FAILURE, trailing_metadata=((SEALED_ERROR_KEY, sealed),))
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
        if not request.HasField("sealed"):
            try:
                if self.require_sealed:
                    raise InvalidRequestError("sealed", SEALED_ONLY)
                async for out in self._generate(request, request.request_id, context):
                    yield out
            except Exception as exc:
                await abort_for(context, exc)
            return
        # Errors about the envelope (it does not open, it is stale or replayed, fields sit outside it) are in the
        # clear: they hold nothing of the payload and the client must act on them. From the payload on, sealed.
        try:
            inner = await self._open(request)
        except Exception as exc:
            await abort_for(context, exc)
        assert self.keys is not None
        sealer = StreamSealer(self.keys, request.request_id)
        try:
            if inner.HasField("sealed"):
                raise InvalidRequestError("sealed", "a sealed request holds the request itself, not another envelope")
            if inner.request_id not in ("", request.request_id):
                raise InvalidRequestError("request_id", "inside the envelope it must be empty or the outer one")
            async for out in self._generate(inner, request.request_id, context):
                yield router_pb2.RouterGenerateResponse(sealed=sealer.seal(out))
        except Exception as exc:
            await abort_sealed(context, exc, sealer)

    async def _generate(
        self, request: router_pb2.RouterGenerateRequest, request_id: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        """One request, plain or opened: every field of `request` counts (for a sealed one, its whole payload)."""
        base = request.request
        self.frontend.check_model(request.model)
        inp = GenerateInput(
            base=base, request_id=request_id or base.request_id,
            prompt=base.prompt or None, prompt_token_ids=list(base.prompt_token_ids) or None,
            thinking=THINKING.get(request.thinking), session_id=request.session_id or None,
            lane=LANES.get(request.priority), timeout_s=context.time_remaining(),
        )  # fmt: skip
        if request.chat:
            if not base.prompt:
                raise InvalidRequestError("chat", "needs a text prompt")
            inp.messages, inp.prompt = [{"role": "user", "content": base.prompt}], None
        job, in_reasoning, _ = await self.frontend.build_async(inp)
        async for d in self.frontend.stream(job, in_reasoning, None, inp.session_id):
            yield router_pb2.RouterGenerateResponse(
                response=d.response, reasoning_delta=d.reasoning, content_delta=d.content, worker=job.worker
            )

    async def _open(self, request: router_pb2.RouterGenerateRequest) -> router_pb2.RouterGenerateRequest:
        if self.keys is None:
            raise InvalidRequestError("sealed", "this router has no SM4 keys (--sm4-key-dir); send plain requests")
        if not request.request_id:
            raise InvalidRequestError("request_id", "required with a sealed request (it is the associated data)")
        outside = sorted(f.name for f, _ in request.ListFields() if f.name not in OUTER_FIELDS)
        if outside:
            # checked before the envelope is opened and its id claimed: a tampered copy spends nothing of the original
            raise InvalidRequestError(outside[0], f"set outside the envelope ({', '.join(outside)}): a sealed request "
                                      "carries every field but request_id inside it")  # fmt: skip
        inner = open_message(self.keys, request.sealed, router_pb2.RouterGenerateRequest, request.request_id,
                             self.guard)  # fmt: skip
        if self.claim is not None:
            key = f"{request.sealed.key_id}:{request.request_id}"
            if not await self.claim(key, self.guard.hold_s(request.sealed.issued_at_ms)):
                raise EnvelopeError(f"request id {request.request_id!r} was already served (by another router "
                                    "replica): a replayed envelope is refused")  # fmt: skip
        return inner

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
