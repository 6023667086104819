"""What the HTTP API accepts before any handler looks at a request: the body as strict JSON (read within a
deadline), the model it names, and the headers it reads as text. Anything that is not valid Unicode is a 400
here, so no later layer (protobuf, hashing, Redis, logging) meets a string it cannot encode: one such string
once stopped the whole queue (issue 33)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

import orjson
from aiohttp import web
from glm5.errors import UnavailableError
from glm5.v1 import worker_pb2

from glm5_router.frontend import MAX_ID_CHARS, Frontend, GenerateInput, check_id
from glm5_router.http import params as fields
from glm5_router.http.errors import ApiError


def parse_body(raw: bytes, max_messages: int) -> dict[str, Any]:
    """The request body as a JSON object. orjson is the only parser: it refuses what json's would let through
    (lone surrogates, NaN and Infinity, nesting past 1,024 levels, which json's parser meets as a RecursionError)."""
    # the event loop parses the body: refuse a chat far over the message limit before building 100,000 dicts
    # (a key spelt with escapes is not counted here; the limit after parsing still holds for it)
    if raw.count(b'"role"') > max_messages:
        raise ApiError(400, f"messages: at most {max_messages}", "invalid_request_error", "messages")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON (UTF-8, no lone surrogates): {exc}",
                       "invalid_request_error") from None  # fmt: skip
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_request_error")
    return body


def text_header(request: web.Request, name: str, max_chars: int = MAX_ID_CHARS) -> str | None:
    """A header the router uses as text (an id): None when absent; 400 when it is not UTF-8 (aiohttp hands such
    bytes over as surrogate escapes), has control characters or is longer than `max_chars`."""
    value = request.headers.get(name)
    if value is None:
        return None
    return check_id(name, value, max_chars)


class Intake:
    """A generation request's way in, shared by the handlers: the body read within a deadline and parsed, the
    model checked, the ids and session taken from the headers, and `n` choices made requests of their own."""

    def __init__(self, frontend: Frontend, limits: fields.Limits, body_timeout_s: float) -> None:
        self.frontend, self.limits, self.body_timeout_s = frontend, limits, body_timeout_s

    def ready(self) -> None:
        if self.frontend.pool.tokenizer is None:
            raise UnavailableError("no worker has answered yet; retry in a moment")

    async def body(self, request: web.Request) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self.body_timeout_s):  # a body sent a byte at a time holds a connection
                raw = await request.read()
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g}s",
                           "invalid_request_error") from None  # fmt: skip
        body = parse_body(raw, self.frontend.config.max_messages)
        self.ready()
        self.frontend.check_model(fields.get(body, "model", str))
        return body

    def input(self, request: web.Request, body: dict[str, Any], base: worker_pb2.GenerateRequest) -> GenerateInput:
        user = fields.get(body, "user", str)
        session = text_header(request, "X-Session-Id") or (check_id("user", user) if user else None)
        rid = text_header(request, "X-Request-Id") or f"req-{uuid.uuid4().hex}"
        return GenerateInput(base=base, request_id=rid, session_id=session, thinking=fields.thinking(body),
                             streamed=fields.get(body, "stream", bool, False))  # fmt: skip

    @staticmethod
    def fan_out(inp: GenerateInput, n: int) -> list[GenerateInput]:
        """One input per choice: ids `<id>-<i>`, a seeded request's seed + i (choices differ, reproducibly)."""
        if n == 1:
            return [inp]
        out = []
        for i in range(n):
            base = worker_pb2.GenerateRequest()
            base.CopyFrom(inp.base)
            if base.sampling.HasField("seed"):
                base.sampling.seed = (base.sampling.seed + i) % 2**64
            out.append(dataclasses.replace(inp, base=base, request_id=f"{inp.request_id}-{i}"))
        return out


__all__ = ["Intake", "parse_body", "text_header"]
