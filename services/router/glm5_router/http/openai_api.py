"""OpenAI-compatible HTTP: GET /v1/models, POST /v1/completions and /v1/chat/completions (`stream: true` as
server-sent events, `reasoning_content` deltas, `tools` / `tool_calls`, usage), /health.

As OpenAI defines them: `n` choices, logprobs, echo, `logit_bias`, presence / frequency penalties and
`response_format` (structured output; vLLM's `guided_*` fields too). Extensions: `top_k`,
`repetition_penalty`; thinking per request through `thinking: {"type": "enabled" | "disabled"}` (GLM API),
`chat_template_kwargs: {"enable_thinking": bool}` (vLLM) or `reasoning_effort` ("low" -> light,
"medium"/"high" -> deep); a session id in the `X-Session-Id` header (or `user`) for affinity and preserved
reasoning. A tool call the registry rejects is returned in `message.tool_call_errors` (never in
`tool_calls`) and the finish reason stays "stop". vLLM's POST /tokenize and /detokenize.

This module wires the routes and answers the small ones; the generation endpoints are chat.py and
completions.py, over intake.py (the body, ids, `n`), streaming.py (stream-or-collect, written once),
formatting.py (OpenAI's shapes) and tool_choice.py.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from glm5.errors import check_vocabulary
from glm5.security import Secret
from glm5.v1 import worker_pb2

from glm5_router.frontend import INLINE_CHARS, Frontend
from glm5_router.http import params as fields
from glm5_router.http.chat import ChatCompletions
from glm5_router.http.completions import Completions
from glm5_router.http.errors import (
    AUTHENTICATED,
    OPEN_PATHS,
    ApiError,
    auth_middleware,
    errors_middleware,
    sealed_only_middleware,
)
from glm5_router.http.intake import Intake

MAX_BODY = 8 << 20  # a 200K-token prompt is ~1 MB of JSON; the body is held whole while it is parsed


class OpenAIServer:
    def __init__(self, frontend: Frontend, api_keys: Sequence[Secret] = (), sealed_only: bool = False,
                 limits: fields.Limits | None = None, max_body: int = MAX_BODY, public_metrics: bool = False,
                 public_health_details: bool = False, body_timeout_s: float = 30.0) -> None:  # fmt: skip
        self.frontend = frontend
        self.public_metrics, self.public_health_details = public_metrics, public_health_details
        self.api_keys, self.sealed_only, self.max_body = tuple(api_keys), sealed_only, max_body
        self.intake = Intake(frontend, limits or fields.Limits(), body_timeout_s)
        self.chat, self.completions = ChatCompletions(self.intake), Completions(self.intake)

    def app(self) -> web.Application:
        middlewares = [errors_middleware(self.max_body)]
        if self.api_keys:
            open_paths = OPEN_PATHS | ({"/metrics"} if self.public_metrics else set())
            middlewares.append(auth_middleware(self.api_keys, open_paths))
        if self.sealed_only:
            middlewares.append(
                sealed_only_middleware(frozenset({"/health", "/metrics", "/v1/models", "/openapi.json"}))
            )
        app = web.Application(client_max_size=self.max_body, middlewares=middlewares)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions.handle)
        app.router.add_post("/v1/chat/completions", self.chat.handle)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        """This API's OpenAPI description (what schemathesis fuzzes; see docs/router.md)."""
        return web.json_response(openapi_description())

    async def health(self, request: web.Request) -> web.Response:
        """Status, queue depth and the dispatcher's state for anyone (probes); the workers' addresses and signals
        only where they are not private: no API keys, a caller with a key, or --public-health-details."""
        pool, dispatcher = self.frontend.pool, self.frontend.dispatcher
        routable = pool.routable()
        ok = bool(routable) and not dispatcher.failing
        body: dict[str, Any] = {
            "status": "ok" if ok else "unavailable", "queued": dispatcher.queues.depth(),
            "workers_routable": len(routable), "workers_known": len(pool.workers),
            "dispatcher": {"failing": dispatcher.failing, "failures": dispatcher.failures,
                           "last_failure": dispatcher.last_failure or None},
        }  # fmt: skip
        if not self.api_keys or self.public_health_details or request.get(AUTHENTICATED, False):
            body["workers"] = [
                {"address": w.address, "healthy": w.healthy, "breaker": w.breaker.current().value,
                 "reason": w.breaker.reason, "in_flight": w.in_flight, "kv_usage": w.kv_usage,
                 "degraded": w.breaker.degraded, "excluded": w.excluded or None}
                for w in pool.workers.values()
            ]  # fmt: skip
        return web.json_response(body, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.frontend.dispatcher.telemetry.exposition()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's: `prompt` or chat `messages` (with `tools` and the thinking fields, applied as the chat endpoint
        applies them) -> the token ids a generation request would send to the workers."""
        body = await self.intake.body(request)
        base = worker_pb2.GenerateRequest(add_special_tokens=fields.get(body, "add_special_tokens", bool, False))
        inp = self.intake.input(request, body, base)
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise ApiError(400, "messages: a list of messages", "invalid_request_error", "messages")
            inp.messages, inp.tools = messages, fields.get(body, "tools", list)
        else:
            inp.prompt = fields.get(body, "prompt", str)
            if inp.prompt is None:
                raise ApiError(400, "prompt: required (or messages)", "invalid_request_error", "prompt")
        large = self.frontend.input_chars(inp) > INLINE_CHARS
        ids = (await asyncio.to_thread(self.frontend.encode, inp) if large else self.frontend.encode(inp))[0]
        return web.json_response({"count": len(ids), "max_model_len": self.frontend.max_model_len, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self.intake.body(request)
        tokens = body.get("tokens")
        tok = self.frontend.tokenizer
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, "tokens: a list of token ids", "invalid_request_error", "tokens")
        check_vocabulary("tokens", tokens, tok.vocab_size)
        return web.json_response({"prompt": tok.decode(tokens)})

    async def models(self, request: web.Request) -> web.Response:
        f = self.frontend
        self.intake.ready()
        data = [
            {"id": f.model_name, "object": "model", "created": 0, "owned_by": "glm5", "max_model_len": f.max_model_len}
        ]
        return web.json_response({"object": "list", "data": data})


@functools.cache
def openapi_description() -> dict[str, Any]:
    return dict(yaml.safe_load((Path(__file__).parent / "openapi.yaml").read_text()))


__all__ = ["OpenAIServer"]
