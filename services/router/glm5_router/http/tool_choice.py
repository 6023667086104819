"""`tools` and `tool_choice` as constraints on what the model may write: "required" or a named function holds the
answer to a tool call (a grammar of the model's tool-call format); "auto" holds each call the model opens to the
offered tools (RouterConfig.tool_call_grammar), where the grammar compiles."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from typing import Any

from glm5.parsing.tools import ToolRegistry, tag_ids
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import worker_pb2

from glm5_router.frontend import INLINE_CHARS, tools_chars
from glm5_router.http.errors import ApiError

log = logging.getLogger(__name__)


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
        self._lock = threading.Lock()  # checks run on threads (constrain_tool_calls)

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


async def registry_for(tools: list[Any]) -> ToolRegistry:
    """ToolRegistry.from_openai, on a thread when the schemas are large (jsonschema took ~19 s to check 2.5 MB
    of them, which the body limit allows): one request's tools must not hold up the others."""
    if tools_chars(tools) > INLINE_CHARS:
        return await asyncio.to_thread(ToolRegistry.from_openai, tools)
    return ToolRegistry.from_openai(tools)


async def force_tool_call(
    tok: Tokenizer, choice: Any, tools: list[Any] | None, base: worker_pb2.GenerateRequest
) -> None:
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
    ids = tag_ids(tok.token_id)
    if ids is None:
        raise ApiError(400, "tool_choice: this model's tokenizer has no tool-call tokens",
                       "invalid_request_error", "tool_choice")  # fmt: skip
    try:
        registry = await registry_for(tools)
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_request_error", "tools") from None
    try:
        grammar = registry.call_grammar(name, ids)
    except ValueError as exc:
        raise ApiError(400, f"tool_choice: {exc}", "invalid_request_error", "tool_choice") from None
    base.sampling.structured_output.lark_grammar = grammar


async def constrain_tool_calls(
    tok: Tokenizer, grammars: GrammarCheck, tools: list[Any], base: worker_pb2.GenerateRequest
) -> None:
    """tool_choice auto (RouterConfig.tool_call_grammar): a lazy grammar holds every call the model opens
    to the tools' names and schemas. Nothing changes where it cannot apply: another output format, a
    tokenizer without tool-call tokens, tools the request's own checks refuse (their error comes from
    there), or schemas llguidance cannot compile (the calls are then parsed and checked as without it).
    The compile check runs on a thread."""
    ids = tag_ids(tok.token_id)
    if base.sampling.HasField("structured_output") or ids is None:
        return
    try:
        grammar = (await registry_for(tools)).call_grammar(None, ids, lazy=True)
    except ValueError:
        return
    error = await asyncio.to_thread(grammars.check, grammar, tok)
    if error:
        log.info("tool_choice auto: the tools' grammar does not compile, calls are not constrained: %s", error)
        return
    base.sampling.structured_output.lark_grammar = grammar
