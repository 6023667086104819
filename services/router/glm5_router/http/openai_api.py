"""OpenAI-compatible HTTP: GET /v1/models, POST /v1/completions and /v1/chat/completions (`stream: true` as
server-sent events, `reasoning_content` deltas, `tools` / `tool_calls`, usage), /health.

As OpenAI defines them: `n` choices, logprobs, echo, `logit_bias`, presence / frequency penalties and
`response_format` (structured output; vLLM's `guided_*` fields too). Extensions: `top_k`,
`repetition_penalty`; thinking per request through `thinking: {"type": "enabled" | "disabled"}` (GLM API),
`chat_template_kwargs: {"enable_thinking": bool}` (vLLM) or `reasoning_effort` ("low" -> light,
"medium"/"high" -> deep); a session id in the `X-Session-Id` header (or `user`) for affinity and preserved
reasoning. A tool call the registry rejects is returned in `message.tool_call_errors` (never in
`tool_calls`) and the finish reason stays "stop". vLLM's POST /tokenize and /detokenize.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiohttp import web
from glm5.errors import UnavailableError, check_vocabulary
from glm5.parsing.reasoning import THINK_CLOSE, THINK_OPEN
from glm5.parsing.tools import ToolCall, ToolCallError, ToolRegistry, tag_ids
from glm5.security import Secret
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import common_pb2, worker_pb2

from glm5_router.frontend import INLINE_CHARS, Delta, Frontend, GenerateInput, check_id, tools_chars
from glm5_router.http import params as fields
from glm5_router.http.errors import (
    AUTHENTICATED,
    OPEN_PATHS,
    ApiError,
    auth_middleware,
    errors_middleware,
    sealed_only_middleware,
    to_api_error,
)
from glm5_router.http.intake import parse_body, text_header

log = logging.getLogger(__name__)
FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
          common_pb2.FINISH_REASON_ABORT: "abort"}  # fmt: skip
MAX_BODY = 8 << 20  # a 200K-token prompt is ~1 MB of JSON; the body is held whole while it is parsed
# JSON allows these raw inside strings, but line-splitting SSE clients (JavaScript, some Python) break on them
LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})
T = TypeVar("T")


def _usage(finals: dict[int, worker_pb2.GenerateResponse], n: int) -> dict[str, Any]:
    """Usage of a request's choices (by index, n per prompt): each prompt once, as OpenAI counts it, and the
    completions summed."""
    firsts = [r.usage for i, r in finals.items() if i % n == 0]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(r.usage.completion_tokens for r in finals.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in firsts)}}  # fmt: skip


class _TextChoice:
    """Per-choice state of a completions response: the raw-text reconstruction and logprob offsets."""

    def __init__(self, index: int, in_reasoning: bool, echo: str, prompt_ids: list[int]) -> None:
        self.index, self.thinking, self.offset, self.pending = index, in_reasoning, 0, echo
        self.prompt_ids = prompt_ids

    def text(self, d: Delta) -> str:
        """The generated text as the model wrote it: the parser's reasoning back inside its tags (an echoed
        prompt first)."""
        out, self.pending = self.pending, ""
        if d.reasoning:
            out += "" if self.thinking else THINK_OPEN
            out, self.thinking = out + d.reasoning, True
        if d.content:
            out += THINK_CLOSE if self.thinking else ""
            out, self.thinking = out + d.content, False
        return out


def _tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    out: dict[str, Any] = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
    if index is not None:
        out["index"] = index
    return out


def _token(tok: Tokenizer, token_id: int) -> str:
    # a token that ends inside a UTF-8 character decodes to U+FFFD on its own, as in vLLM's logprobs
    return tok.decode([token_id])


def _chat_logprobs(tok: Tokenizer, lps: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat `choice.logprobs`: one entry per generated token, reasoning tokens included."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token(tok, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}
            for lp in lps
        ]
    }


def _completion_logprobs(
    tok: Tokenizer, lps: list[common_pb2.TokenLogprob | None], token_ids: list[int], offset: int
) -> dict[str, Any]:
    """OpenAI completions `choice.logprobs`; None entries (the echoed prompt's first token) have no logprob."""
    tokens = [_token(tok, t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob if lp is not None else None for lp in lps],
        "top_logprobs": [
            {_token(tok, t.token_id): t.logprob for t in lp.top} if lp is not None else None for lp in lps
        ],
        "text_offset": offsets,
    }


class GrammarCheck:
    """Whether a grammar compiles against the served tokenizer (llguidance, as the worker compiles it), so the
    router attaches only grammars the worker accepts; the answers for the last `capacity` grammars are kept
    (agents resend the same tools every turn)."""

    def __init__(self, capacity: int = 256) -> None:
        self._capacity = capacity
        self._source: Tokenizer | None = None
        self._tokenizer: Any = None
        # by the grammar's digest (a grammar can be megabytes), the error cut short: the cache stays small
        self._answers: dict[bytes, str] = {}
        self._lock = threading.Lock()  # checks run on threads (OpenAIServer._constrain_tool_calls)

    def check(self, grammar: str, tok: Tokenizer) -> str:
        """'' when `grammar` compiles against `tok`, else llguidance's error (up to 300 characters). Takes up to
        about a second for large schemas: call it off the event loop."""
        import llguidance

        key = hashlib.sha256(grammar.encode()).digest()
        with self._lock:
            if tok is not self._source:  # built on first use (most requests offer no tools), again for a new one
                self._source, self._answers = tok, {}
                self._tokenizer = llguidance.LLTokenizer(tok.files[0].decode(), n_vocab=tok.vocab_size,
                                                         eos_token=tok.eos_token_ids())  # fmt: skip
            if key in self._answers:
                self._answers[key] = self._answers.pop(key)  # most recently used last
                return self._answers[key]
            try:
                error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar),
                                                              self._tokenizer) or ""  # fmt: skip
            except ValueError as exc:
                error = str(exc)
            if len(self._answers) >= self._capacity:
                del self._answers[next(iter(self._answers))]
            self._answers[key] = error.strip()[:300]
            return self._answers[key]


class OpenAIServer:
    def __init__(self, frontend: Frontend, api_keys: Sequence[Secret] = (), sealed_only: bool = False,
                 limits: fields.Limits | None = None, max_body: int = MAX_BODY, public_metrics: bool = False,
                 public_health_details: bool = False, body_timeout_s: float = 30.0) -> None:  # fmt: skip
        self.frontend = frontend
        self._grammars = GrammarCheck()
        self.body_timeout_s = body_timeout_s
        self.public_metrics, self.public_health_details = public_metrics, public_health_details
        self.api_keys, self.sealed_only, self.limits, self.max_body = (
            tuple(api_keys),
            sealed_only,
            limits or fields.Limits(),
            max_body,
        )

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
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
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
        body = await self._body(request)
        base = worker_pb2.GenerateRequest(add_special_tokens=fields.get(body, "add_special_tokens", bool, False))
        inp = self._input(request, body, base)
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
        body = await self._body(request)
        tokens = body.get("tokens")
        tok = self.frontend.tokenizer
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, "tokens: a list of token ids", "invalid_request_error", "tokens")
        check_vocabulary("tokens", tokens, tok.vocab_size)
        return web.json_response({"prompt": tok.decode(tokens)})

    async def models(self, request: web.Request) -> web.Response:
        f = self.frontend
        self._ready()
        data = [
            {"id": f.model_name, "object": "model", "created": 0, "owned_by": "glm5", "max_model_len": f.max_model_len}
        ]
        return web.json_response({"object": "list", "data": data})

    def _ready(self) -> None:
        if self.frontend.pool.tokenizer is None:
            raise UnavailableError("no worker has answered yet; retry in a moment")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self.body_timeout_s):  # a body sent a byte at a time holds a connection
                raw = await request.read()
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g}s",
                           "invalid_request_error") from None  # fmt: skip
        body = parse_body(raw, self.frontend.config.max_messages)
        self._ready()
        self.frontend.check_model(fields.get(body, "model", str))
        return body

    def _input(self, request: web.Request, body: dict[str, Any], base: worker_pb2.GenerateRequest) -> GenerateInput:
        user = fields.get(body, "user", str)
        session = text_header(request, "X-Session-Id") or (check_id("user", user) if user else None)
        rid = text_header(request, "X-Request-Id") or f"req-{uuid.uuid4().hex}"
        return GenerateInput(base=base, request_id=rid, session_id=session, thinking=fields.thinking(body),
                             streamed=fields.get(body, "stream", bool, False))  # fmt: skip

    def _fan_out(self, inp: GenerateInput, n: int) -> list[GenerateInput]:
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

    # -- /v1/completions ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        base = fields.sampling(body, self.limits)
        n = fields.choices(body)
        logprobs = fields.logprobs_count(body, "logprobs")
        if logprobs is not None:
            base.return_logprobs, base.top_logprobs = True, logprobs
        echo = fields.get(body, "echo", bool, False)
        base.return_prompt_logprobs = echo and base.return_logprobs
        inp = self._input(request, body, base)
        prompts = fields.prompts(body.get("prompt"))
        if len(prompts) * n > fields.MAX_CHOICES:  # `n` x prompts, each a request of its own
            raise ApiError(400, f"prompt: {len(prompts)} prompts x n={n} choices is more than {fields.MAX_CHOICES}",
                           "invalid_request_error", "prompt")  # fmt: skip
        inputs = []
        for k, prompt in enumerate(prompts):
            one = dataclasses.replace(inp, request_id=f"{inp.request_id}-p{k}" if len(prompts) > 1 else inp.request_id)
            if isinstance(prompt, str):
                one.prompt = prompt
            else:
                one.prompt_token_ids = prompt
            inputs += self._fan_out(one, n)
        built = [
            await self.frontend.build_async(x) for x in inputs
        ]  # choice index = prompt index * n + choice, as OpenAI's
        streams = [self.frontend.stream(job, in_reasoning, None, inp.session_id) for job, in_reasoning, _ in built]
        cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.frontend.model_name
        tok = self.frontend.tokenizer
        choices = []
        for i, ((job, in_reasoning, _), one) in enumerate(zip(built, inputs, strict=True)):
            ids = list(job.request.prompt_token_ids)
            choices.append(_TextChoice(i, in_reasoning, (one.prompt or tok.decode(ids)) if echo else "", ids))

        def choice_json(c: _TextChoice, text: str, finish: str | None,
                        resp: worker_pb2.GenerateResponse) -> dict[str, Any]:  # fmt: skip
            out: dict[str, Any] = {"index": c.index, "text": text, "finish_reason": finish, "logprobs": None}
            if base.return_logprobs:
                lps: list[common_pb2.TokenLogprob | None] = list(resp.logprobs)
                ids = [lp.token_id for lp in resp.logprobs]
                if base.return_prompt_logprobs and resp.prompt_logprobs:  # the echoed prompt comes first
                    lps, ids = [None, *resp.prompt_logprobs, *lps], c.prompt_ids + ids
                out["logprobs"] = _completion_logprobs(tok, lps, ids, c.offset)
            c.offset += len(text)
            return out

        head = {"id": cid, "object": "text_completion", "created": created, "model": model}
        if fields.get(body, "stream", bool, False):

            def chunk(i: int, d: Delta) -> dict[str, Any] | None:
                finish = FINISH.get(d.response.finish_reason)
                text = choices[i].text(d)
                return choice_json(choices[i], text, finish, d.response) if text or finish else None

            return await self._stream(request, inp.request_id, streams, head, body, n, chunk)

        async def collect(c: _TextChoice, stream: AsyncIterator[Delta]) -> tuple[dict[str, Any], Any]:
            parts, merged, last = [], worker_pb2.GenerateResponse(), None
            async for d in stream:
                parts.append(c.text(d))
                merged.logprobs.extend(d.response.logprobs)
                if d.response.prompt_logprobs and not merged.prompt_logprobs:
                    merged.prompt_logprobs.extend(d.response.prompt_logprobs)
                last = d.response
            assert last is not None
            return choice_json(c, "".join(parts), FINISH.get(last.finish_reason), merged), last

        done = await _all([collect(c, s) for c, s in zip(choices, streams, strict=True)])
        usage = _usage({i: r for i, (_, r) in enumerate(done)}, n)
        return web.json_response({**head, "choices": [c for c, _ in done], "usage": usage})

    # -- /v1/chat/completions -------------------------------------------------------------------------

    @staticmethod
    async def _registry(tools: list[Any]) -> ToolRegistry:
        """ToolRegistry.from_openai, on a thread when the schemas are large (jsonschema took ~19 s to check 2.5 MB
        of them, which the body limit allows): one request's tools must not hold up the others."""
        if tools_chars(tools) > INLINE_CHARS:
            return await asyncio.to_thread(ToolRegistry.from_openai, tools)
        return ToolRegistry.from_openai(tools)

    async def _force_tool_call(self, choice: Any, tools: list[Any] | None, base: worker_pb2.GenerateRequest) -> None:
        """tool_choice "required" (one or more calls) or {"type": "function", "function": {"name": N}} (one call
        to N): a grammar of the model's tool-call format holds the answer to it (structured output)."""
        function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if choice != "required" and not isinstance(name, str):
            raise ApiError(400, "tool_choice: 'auto', 'none', 'required' or {'type': 'function', 'function': "
                           "{'name': ...}}", "invalid_request_error", "tool_choice")  # fmt: skip
        if not tools:
            raise ApiError(400, "tool_choice: needs tools", "invalid_request_error", "tool_choice")
        if base.sampling.HasField("structured_output"):
            raise ApiError(400, "tool_choice: cannot be combined with another output format",
                           "invalid_request_error", "tool_choice")  # fmt: skip
        ids = tag_ids(self.frontend.tokenizer.token_id)
        if ids is None:
            raise ApiError(400, "tool_choice: this model's tokenizer has no tool-call tokens",
                           "invalid_request_error", "tool_choice")  # fmt: skip
        try:
            registry = await self._registry(tools)
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_request_error", "tools") from None
        try:
            grammar = registry.call_grammar(name, ids)
        except ValueError as exc:
            raise ApiError(400, f"tool_choice: {exc}", "invalid_request_error", "tool_choice") from None
        base.sampling.structured_output.lark_grammar = grammar

    async def _constrain_tool_calls(self, tools: list[Any], base: worker_pb2.GenerateRequest) -> None:
        """tool_choice auto (RouterConfig.tool_call_grammar): a lazy grammar holds every call the model opens
        to the tools' names and schemas. Nothing changes where it cannot apply: another output format, a
        tokenizer without tool-call tokens, tools the request's own checks refuse (their error comes from
        there), or schemas llguidance cannot compile (the calls are then parsed and checked as without it).
        The compile check runs on a thread."""
        tok = self.frontend.tokenizer
        ids = tag_ids(tok.token_id)
        if base.sampling.HasField("structured_output") or ids is None:
            return
        try:
            grammar = (await self._registry(tools)).call_grammar(None, ids, lazy=True)
        except ValueError:
            return
        error = await asyncio.to_thread(self._grammars.check, grammar, tok)
        if error:
            log.info("tool_choice auto: the tools' grammar does not compile, calls are not constrained: %s", error)
            return
        base.sampling.structured_output.lark_grammar = grammar

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        base = fields.sampling(body, self.limits)
        n = fields.choices(body)
        if fields.get(body, "logprobs", bool, False):
            base.return_logprobs = True
            base.top_logprobs = fields.logprobs_count(body, "top_logprobs") or 0
        elif fields.logprobs_count(body, "top_logprobs"):
            raise ApiError(400, "top_logprobs: needs logprobs: true", "invalid_request_error", "top_logprobs")
        inp = self._input(request, body, base)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ApiError(400, "messages: required, a list of messages", "invalid_request_error", "messages")
        inp.messages = messages
        tools = fields.get(body, "tools", list)
        choice_mode = body.get("tool_choice", "auto")
        inp.tools = tools if choice_mode != "none" else None
        if choice_mode not in ("auto", "none"):
            await self._force_tool_call(choice_mode, tools, base)
        elif choice_mode == "auto" and tools and self.frontend.config.tool_call_grammar:
            await self._constrain_tool_calls(tools, base)
        built = [await self.frontend.build_async(x) for x in self._fan_out(inp, n)]
        streams = [
            self.frontend.stream(job, in_reasoning, registry, inp.session_id, operation="chat")
            for job, in_reasoning, registry in built
        ]
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.frontend.model_name
        tok = self.frontend.tokenizer

        def lp_json(lps: list[common_pb2.TokenLogprob]) -> dict[str, Any] | None:
            return _chat_logprobs(tok, lps) if base.return_logprobs else None

        if fields.get(body, "stream", bool, False):
            head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
            n_calls = [0] * n

            def chunk(i: int, d: Delta) -> dict[str, Any] | None:
                delta: dict[str, Any] = {}
                if d.reasoning:
                    delta["reasoning_content"] = d.reasoning
                if d.content:
                    delta["content"] = d.content
                calls = [r for r in d.tool_results if isinstance(r, ToolCall)]
                errors = [r for r in d.tool_results if isinstance(r, ToolCallError)]
                if calls:
                    delta["tool_calls"] = [_tool_call_json(c, n_calls[i] + k) for k, c in enumerate(calls)]
                    n_calls[i] += len(calls)
                if errors:
                    delta["tool_call_errors"] = [{"name": e.name, "error": e.error} for e in errors]
                finish = FINISH.get(d.response.finish_reason)
                if finish == "stop" and n_calls[i]:
                    finish = "tool_calls"
                choice = {"index": i, "delta": delta, "finish_reason": finish}
                if base.return_logprobs:
                    choice["logprobs"] = lp_json(list(d.response.logprobs))
                return choice if delta or finish or (base.return_logprobs and d.response.logprobs) else None

            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                       for i in range(n)]  # fmt: skip
            return await self._stream(request, inp.request_id, streams, head, body, n, chunk, opening)

        async def collect(i: int, stream: AsyncIterator[Delta]) -> tuple[dict[str, Any], Any]:
            reasoning, content, calls, errors, last = [], [], [], [], None
            lps: list[common_pb2.TokenLogprob] = []
            async for d in stream:
                lps += d.response.logprobs
                reasoning.append(d.reasoning)
                content.append(d.content)
                calls += [r for r in d.tool_results if isinstance(r, ToolCall)]
                errors += [r for r in d.tool_results if isinstance(r, ToolCallError)]
                last = d.response
            assert last is not None
            message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or (None if calls else ""),
                                       "refusal": None, "reasoning_content": "".join(reasoning) or None}  # fmt: skip
            if calls:
                message["tool_calls"] = [_tool_call_json(c) for c in calls]
            if errors:
                message["tool_call_errors"] = [{"name": e.name, "error": e.error} for e in errors]
            finish = FINISH.get(last.finish_reason)
            if finish == "stop" and calls:
                finish = "tool_calls"
            return {"index": i, "message": message, "finish_reason": finish, "logprobs": lp_json(lps)}, last

        done = await _all([collect(i, s) for i, s in enumerate(streams)])
        usage = _usage({i: r for i, (_, r) in enumerate(done)}, n)
        return web.json_response({"id": cid, "object": "chat.completion", "created": created, "model": model,
                                  "choices": [c for c, _ in done], "usage": usage})  # fmt: skip

    async def _stream(
        self,
        request: web.Request,
        request_id: str,
        streams: list[AsyncIterator[Delta]],
        head: dict[str, Any],
        body: dict[str, Any],
        n: int,
        chunk: Callable[[int, Delta], dict[str, Any] | None],
        opening: Sequence[dict[str, Any]] = (),
    ) -> web.StreamResponse:
        """The SSE answer of a completion or chat request: `opening` choices first, then `chunk(i, delta)` (None:
        nothing to send) for each choice's deltas as they come, the usage chunk if asked, errors as an error
        event, then [DONE]. The streams start (the first token or an error) before the 200 goes out."""
        streams = await _primed_all(streams)
        sse = await self._start_sse(request)
        for first in opening:
            await _send(sse, {**head, "choices": [first]})
        finals: dict[int, worker_pb2.GenerateResponse] = {}
        try:
            async for i, d in _merged(streams):
                choice = chunk(i, d)
                if choice is not None:
                    await _send(sse, {**head, "choices": [choice]})
                if FINISH.get(d.response.finish_reason):
                    finals[i] = d.response
            if len(finals) == len(streams) and (body.get("stream_options") or {}).get("include_usage"):
                await _send(sse, {**head, "choices": [], "usage": _usage(finals, n)})
        except ConnectionError:  # the client left: its requests are cancelled as the streams close
            log.info("client %s left request %s", request.remote, request_id)
            return sse
        except Exception as exc:
            await _send(sse, to_api_error(exc).body())
        await sse.write(b"data: [DONE]\n\n")
        return sse

    async def _start_sse(self, request: web.Request) -> web.StreamResponse:
        sse = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await sse.prepare(request)
        return sse


@functools.cache
def openapi_description() -> dict[str, Any]:
    return dict(yaml.safe_load((Path(__file__).parent / "openapi.yaml").read_text()))


def sse_event(payload: dict[str, Any]) -> bytes:
    text = json.dumps(payload, ensure_ascii=False)
    if not text.isascii():
        text = text.translate(LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


async def _send(sse: web.StreamResponse, payload: dict[str, Any]) -> None:
    await sse.write(sse_event(payload))


async def _all(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Runs a request's choices together; one failing cancels the others (their workers stop generating)."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) as each choice's deltas arrive; the first error ends them all."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for d in stream:
                await queue.put((i, d))
            await queue.put((i, None))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _primed_all(streams: list[AsyncIterator[Delta]]) -> list[AsyncIterator[Delta]]:
    """_primed for every choice at once; if one fails before its first delta, the others are closed."""
    if len(streams) == 1:
        return [await _primed(streams[0])]
    tasks = [asyncio.ensure_future(_primed(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]  # an async generator: its request is cancelled
        raise


async def _primed(stream: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """Wait for the first delta before the SSE headers go out, so queue-full, deadline and unavailable
    errors still get their HTTP status (429 / 408 / 503) instead of a 200 with an error event."""
    it = aiter(stream)
    try:
        first = await anext(it)
    except StopAsyncIteration:
        first = None

    async def chained() -> AsyncIterator[Delta]:
        if first is not None:
            yield first
        async for d in it:
            yield d

    return chained()


__all__ = ["OpenAIServer", "sse_event", "to_api_error"]
