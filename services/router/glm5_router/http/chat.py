"""POST /v1/chat/completions: messages through the chat template, `n` choices, reasoning split from content,
tool calls parsed and checked against the offered tools (a call the registry rejects goes to
`tool_call_errors`, never `tool_calls`), `tool_choice` as a constraint (http.tool_choice), logprobs."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from glm5.parsing.tools import ToolCall, ToolCallError
from glm5.v1 import common_pb2, worker_pb2

from glm5_router.frontend import Delta
from glm5_router.http import params as fields
from glm5_router.http.errors import ApiError
from glm5_router.http.formatting import FINISH, chat_logprobs, tool_call_json
from glm5_router.http.intake import Intake
from glm5_router.http.streaming import respond
from glm5_router.http.tool_choice import GrammarCheck, constrain_tool_calls, force_tool_call


class ChatCompletions:
    def __init__(self, intake: Intake) -> None:
        self.intake, self.frontend = intake, intake.frontend
        self.grammars = GrammarCheck()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await self.intake.body(request)
        base = fields.sampling(body, self.intake.limits)
        n = fields.choices(body)
        if fields.get(body, "logprobs", bool, False):
            base.return_logprobs = True
            base.top_logprobs = fields.logprobs_count(body, "top_logprobs") or 0
        elif fields.logprobs_count(body, "top_logprobs"):
            raise ApiError(400, "top_logprobs: needs logprobs: true", "invalid_request_error", "top_logprobs")
        inp = self.intake.input(request, body, base)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ApiError(400, "messages: required, a list of messages", "invalid_request_error", "messages")
        inp.messages = messages
        tools = fields.get(body, "tools", list)
        choice_mode = body.get("tool_choice", "auto")
        inp.tools = tools if choice_mode != "none" else None
        tok = self.frontend.tokenizer
        if choice_mode not in ("auto", "none"):
            await force_tool_call(tok, choice_mode, tools, base)
        elif choice_mode == "auto" and tools and self.frontend.config.tool_call_grammar:
            await constrain_tool_calls(tok, self.grammars, tools, base)
        built = [await self.frontend.build_async(x) for x in self.intake.fan_out(inp, n)]
        streams = [
            self.frontend.stream(job, in_reasoning, registry, inp.session_id, operation="chat")
            for job, in_reasoning, registry in built
        ]

        def lp_json(lps: list[common_pb2.TokenLogprob]) -> dict[str, Any] | None:
            return chat_logprobs(tok, lps) if base.return_logprobs else None

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
                delta["tool_calls"] = [tool_call_json(c, n_calls[i] + k) for k, c in enumerate(calls)]
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

        async def collect(i: int, stream: AsyncIterator[Delta]) -> tuple[dict[str, Any], worker_pb2.GenerateResponse]:
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
                message["tool_calls"] = [tool_call_json(c) for c in calls]
            if errors:
                message["tool_call_errors"] = [{"name": e.name, "error": e.error} for e in errors]
            finish = FINISH.get(last.finish_reason)
            if finish == "stop" and calls:
                finish = "tool_calls"
            return {"index": i, "message": message, "finish_reason": finish, "logprobs": lp_json(lps)}, last

        cid, objects = f"chatcmpl-{uuid.uuid4().hex}", ("chat.completion.chunk", "chat.completion")
        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                   for i in range(n)]  # fmt: skip
        return await respond(request, inp.request_id, body, streams, n, cid, self.frontend.model_name, objects, chunk,
                             collect, opening)  # fmt: skip
