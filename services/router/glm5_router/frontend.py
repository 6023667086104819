"""What both front doors (gRPC and HTTP) share: turn a request into a Job (chat template, thinking mode,
tokenisation, lane, affinity, validation) and turn the worker's stream into reasoning / content / tool-call
deltas."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from glm5.errors import InvalidRequestError, UnavailableError, check_vocabulary
from glm5.parsing.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningParser
from glm5.parsing.tools import ToolCall, ToolCallError, ToolCallParser, ToolRegistry
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import common_pb2, worker_pb2
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from glm5_router.config import RouterConfig
from glm5_router.scheduling.dispatcher import Dispatcher, validate_job_fits
from glm5_router.scheduling.job import Job, Lane
from glm5_router.workers.pool import WorkerPool

Thinking = Literal["off", "light", "deep"]
STRUCTURAL = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
              "</arg_value>"}  # fmt: skip
AFFINITY_PREFIX_TOKENS = 64
LONE_CLOSE_STREAM_HOLD = 64  # characters of a streamed non-thinking answer held to see a lone </think> (docs/router.md)
INLINE_CHARS = 32 << 10  # inputs up to this size are tokenised on the event loop (well under a millisecond)


def tools_chars(tools: list[Any] | None) -> int:
    """The size of a request's tool definitions as JSON (they came as JSON, so they serialise)."""
    return len(json.dumps(tools)) if tools else 0


# request and session ids are ids, not payloads: they travel in log lines, Redis keys and the reasoning store
MAX_ID_CHARS = 256
# OpenAI's roles -> the chat template's: `developer` is OpenAI's current name for system, `function` the
# deprecated form of a tool result
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "function": "tool"}  # fmt: skip
_CODE = re.compile(r"```|(^|\n)( {4}|\t)\S")


def check_id(name: str, value: str, max_chars: int = MAX_ID_CHARS) -> str:
    """`value` if it can serve as an id in keys, hashes and log lines; otherwise InvalidRequestError naming `name`."""
    if len(value) > max_chars:
        raise InvalidRequestError(name, f"at most {max_chars} characters")
    if not value.isprintable():  # lone surrogates (a header that was not UTF-8) and control characters
        raise InvalidRequestError(name, "must be printable UTF-8 text")
    return value


@dataclass
class GenerateInput:
    base: worker_pb2.GenerateRequest  # sampling, logprob options; prompt fields are replaced
    request_id: str = ""
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    thinking: Thinking | None = None
    session_id: str | None = None
    lane: Lane | None = None
    timeout_s: float | None = None
    streamed: bool = True  # the client sees deltas as they come (False: one whole answer, as HTTP without stream)


@dataclass
class Delta:
    response: worker_pb2.GenerateResponse
    reasoning: str = ""
    content: str = ""
    tool_results: list[ToolCall | ToolCallError] = field(default_factory=list)


class ReasoningStore:
    """Preserved reasoning: per session, assistant answer -> the reasoning that produced it, so a later turn
    can send the reasoning back to the model without the client keeping it. LRU per session, bounded; when
    full the oldest 20% go."""

    def __init__(self, capacity: int, max_sessions: int = 10000) -> None:
        self.capacity = capacity
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, OrderedDict[str, str]] = OrderedDict()

    @staticmethod
    def _key(content: str) -> str:
        return hashlib.sha256(content.strip().encode()).hexdigest()[:32]

    def put(self, session: str, content: str, reasoning: str) -> None:
        entries = self._sessions.setdefault(session, OrderedDict())
        self._sessions.move_to_end(session)
        if len(entries) >= self.capacity:
            for _ in range(max(1, self.capacity // 5)):
                entries.popitem(last=False)
        entries[self._key(content)] = reasoning
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def get(self, session: str, content: str) -> str | None:
        entries = self._sessions.get(session)
        if entries is None:
            return None
        key = self._key(content)
        if key in entries:
            entries.move_to_end(key)
            return entries[key]
        return None

    def __len__(self) -> int:
        return sum(len(e) for e in self._sessions.values())


class Frontend:
    def __init__(self, config: RouterConfig, pool: WorkerPool, dispatcher: Dispatcher) -> None:
        self.config = config
        self.pool = pool
        self.dispatcher = dispatcher
        self.reasoning = ReasoningStore(config.reasoning_cache_entries)
        # Where jobs go: the in-process dispatcher, or the shared Redis queue (set by the app).
        self.submit: Callable[[Job], AsyncGenerator[worker_pb2.GenerateResponse, None]] = dispatcher.submit
        self._strip: re.Pattern[str] | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        if self.pool.tokenizer is None:
            raise UnavailableError("no worker has answered yet; retry in a moment")
        return self.pool.tokenizer

    @property
    def model_name(self) -> str:
        info = self.pool.model_info
        return self.config.served_model_name or (info.served_model_name if info else "") or "glm5"

    @property
    def max_model_len(self) -> int:
        return int(self.pool.model_info.max_model_len) if self.pool.model_info else 0

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise InvalidRequestError("model", f"unknown model {model!r}; this router serves {self.model_name!r}")

    def resolve_thinking(self, requested: Thinking | None, text: str) -> Thinking:
        if requested is not None:
            return requested
        policy = self.config.thinking_policy
        if policy != "auto":
            return policy
        # Auto: code in the prompt turns reasoning on; plain conversation goes straight to the answer.
        return "deep" if _CODE.search(text) else "off"

    # -- request -> job -------------------------------------------------------------------------------

    async def build_async(self, inp: GenerateInput) -> tuple[Job, bool, ToolRegistry | None]:
        """build(), on a thread when the input is large: tokenising it must not hold up other requests (the
        tokenizer releases the GIL while it works, see Tokenizer.encode_bounded)."""
        if self.input_chars(inp) > INLINE_CHARS or tools_chars(inp.tools) > INLINE_CHARS:
            # checking large tool schemas takes as long (jsonschema: ~19 s for 2.5 MB of them, measured)
            return await asyncio.to_thread(self.build, inp)
        return self.build(inp)

    def input_chars(self, inp: GenerateInput) -> int:
        """Characters of text the request brings (prompt, or messages' contents); over --max-prompt-chars it is
        refused here, before any tokenising."""
        if inp.messages is not None:
            if len(inp.messages) > self.config.max_messages:
                raise InvalidRequestError("messages", f"at most {self.config.max_messages}, got {len(inp.messages)}")
            chars = sum(_content_chars(m) for m in inp.messages)
        else:
            chars = len(inp.prompt or "") + len(inp.prompt_token_ids or ())
        if chars > self.config.max_prompt_chars:
            raise InvalidRequestError(
                "prompt", f"{chars} characters, more than the limit {self.config.max_prompt_chars}"
            )
        return chars

    def build(self, inp: GenerateInput) -> tuple[Job, bool, ToolRegistry | None]:
        """The job, whether the output starts inside <think>, and the tool registry of a chat request."""
        for name, value in (("request_id", inp.request_id), ("session_id", inp.session_id)):
            if value:
                check_id(name, value, MAX_ID_CHARS + 32)  # room for the choices' and prompts' -p<k>-<i> suffixes
        ids, text, thinking, registry = self.encode(inp)
        hidden = thinking == "off" and self._reasons_anyway(inp)
        job = self._job(inp, ids, "deep" if hidden else thinking)
        job.hide_reasoning = hidden
        if text.rstrip().endswith(THINK_OPEN + THINK_CLOSE):  # the template closed the think block: "off" (skip)
            # a model that reasons anyway ends its reasoning with a lone </think>: held back this far to see (all of
            # it when nothing streams; a few tokens' delay when it does)
            job.lone_close_hold = LONE_CLOSE_STREAM_HOLD if inp.streamed else 1 << 30
        in_reasoning = text.rstrip().endswith(THINK_OPEN)
        if job.request.sampling.HasField("structured_output") and (thinking != "off" or hidden or in_reasoning):
            # the format applies to the answer: thinking before it stays free
            fmt = job.request.sampling.structured_output
            fmt.think_open_token_id = self.tokenizer.encode(THINK_OPEN)[-1]
            fmt.think_close_token_id = self.tokenizer.encode(THINK_CLOSE)[-1]
            fmt.starts_thinking = in_reasoning
        return job, in_reasoning, registry

    def encode(self, inp: GenerateInput) -> tuple[list[int], str, Thinking, ToolRegistry | None]:
        """The prompt's token ids, its text (chat template applied; "" for token ids), the thinking mode and
        the tool registry of a chat request."""
        self.input_chars(inp)
        if sum(x is not None for x in (inp.prompt, inp.prompt_token_ids, inp.messages)) > 1:
            raise InvalidRequestError("prompt", "give one of prompt, prompt_token_ids or messages: which wins would be "
                                      "a guess")  # fmt: skip
        tok = self.tokenizer
        registry: ToolRegistry | None = None
        thinking: Thinking = "off"
        if inp.messages is not None:
            if inp.tools is not None and len(inp.tools) > self.config.max_tools:
                raise InvalidRequestError("tools", f"at most {self.config.max_tools}, got {len(inp.tools)}")
            try:
                registry = ToolRegistry.from_openai(inp.tools)
            except ValueError as exc:
                raise InvalidRequestError("tools", str(exc)) from exc
            messages = self._messages(inp.messages, inp.session_id)
            last_user = next((str(m.get("content") or "") for m in reversed(messages) if m["role"] == "user"), "")
            thinking = self.resolve_thinking(inp.thinking, last_user)
            # a model that reasons whatever the template says thinks, and "off" hides its reasoning instead
            think = thinking != "off" or self._reasons_anyway(inp)
            ids, text = tok.encode_chat(
                messages, self._token_limit(), tools=inp.tools or None, enable_thinking=think,
                thinking_budget=self.config.light_thinking_budget if thinking == "light" else None,
            )  # fmt: skip
        elif inp.prompt_token_ids:
            check_vocabulary("prompt_token_ids", inp.prompt_token_ids, tok.vocab_size)
            ids, text = list(inp.prompt_token_ids), ""
        elif inp.prompt:
            text = inp.prompt
            ids = tok.encode_bounded(text, self._token_limit(), inp.base.add_special_tokens)
        else:
            raise InvalidRequestError("prompt", "give a prompt, prompt_token_ids or messages")
        if not ids:
            raise InvalidRequestError("prompt", "the prompt is empty after tokenisation")
        return ids, text, thinking, registry

    def _reasons_anyway(self, inp: GenerateInput) -> bool:
        """The model's tokenizer_config.json says `"glm5_thinking_off": "hide"`: it was trained to reason before
        every answer (the shipped demo model), so a template that skips the thinking confuses it, and "off" means
        the reasoning is generated but not returned. Otherwise ("skip", the default, as GLM-5) "off" renders the
        template's non-thinking mode and the model answers at once."""
        return inp.messages is not None and self.tokenizer.config.get("glm5_thinking_off") == "hide"

    def _token_limit(self) -> int:
        # the prompt must leave room for one new token
        return self.max_model_len - 1 if self.max_model_len else self.config.max_prompt_chars

    def _job(self, inp: GenerateInput, ids: list[int], thinking: Thinking) -> Job:
        s = inp.base.sampling
        max_new = s.max_new_tokens if s.HasField("max_new_tokens") else self.config.default_max_new_tokens
        if max_new < 1:
            raise InvalidRequestError("max_new_tokens", f"must be >= 1, got {max_new}")
        request = worker_pb2.GenerateRequest()
        request.CopyFrom(inp.base)
        request.ClearField("prompt")
        request.prompt_token_ids[:] = ids
        request.sampling.max_new_tokens = max_new
        request.skip_special_tokens = False  # the router needs <think> / <tool_call> to split the output
        if not request.stream_interval:
            request.stream_interval = self.config.stream_interval
        request.request_id = inp.request_id or request.request_id or f"req-{uuid.uuid4().hex}"
        lane = inp.lane or self._lane(len(ids))
        affinity = inp.session_id or (
            hashlib.sha256(str(ids[:AFFINITY_PREFIX_TOKENS]).encode()).hexdigest()
            if len(ids) >= AFFINITY_PREFIX_TOKENS else None
        )  # fmt: skip
        timeout = inp.timeout_s if inp.timeout_s is not None else self.config.queue_timeout_s
        job = Job(request.request_id, request, len(ids), max_new, lane, time.monotonic() + timeout, affinity)
        if self.max_model_len:
            validate_job_fits(job, self.max_model_len)
        if thinking == "light":
            job.reasoning_budget = self.config.light_thinking_budget
        return job

    def _lane(self, prompt_tokens: int) -> Lane:
        if prompt_tokens < self.config.short_max_prompt_tokens:
            return "short"
        return "long" if prompt_tokens >= self.config.long_min_prompt_tokens else "medium"

    def _messages(self, messages: list[dict[str, Any]], session: str | None) -> list[dict[str, Any]]:
        if not messages:
            raise InvalidRequestError("messages", "must not be empty")
        if len(messages) > self.config.max_messages:
            raise InvalidRequestError("messages", f"at most {self.config.max_messages}, got {len(messages)}")
        out = []
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ROLES:
                raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
            m = dict(m, role=ROLES[role])
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: this model reads text only
                for j, part in enumerate(content):
                    if (
                        not isinstance(part, dict)
                        or part.get("type") != "text"
                        or not isinstance(part.get("text"), str)
                    ):
                        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                        raise InvalidRequestError(
                            f"messages[{i}].content[{j}]",
                            f"only text parts are supported (this model reads text), got {kind!r}",
                        )
                m["content"] = "".join(part["text"] for part in content)
            elif content is not None and not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of text parts")
            if m["role"] == "assistant":
                calls = m.get("tool_calls") or []
                if not isinstance(calls, list):
                    raise InvalidRequestError(f"messages[{i}].tool_calls", "must be a list of tool calls")
                m["tool_calls"] = [_decode_call(i, tc) for tc in calls]
                if not m.get("reasoning_content") and session and m.get("content"):
                    m["reasoning_content"] = self.reasoning.get(session, m["content"]) or ""
            out.append(m)
        return out

    # -- worker stream -> deltas ----------------------------------------------------------------------

    async def stream(
        self,
        job: Job,
        in_reasoning: bool,
        registry: ToolRegistry | None,
        session: str | None = None,
        operation: str = "text_completion",
    ) -> AsyncIterator[Delta]:
        """The worker's stream as deltas, inside a server span with gen_ai.* attributes, with metrics."""
        t = self.dispatcher.telemetry
        s = job.request.sampling
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation, "gen_ai.system": "glm5", "gen_ai.request.model": self.model_name,
            "gen_ai.request.max_tokens": job.max_new_tokens, "glm5.request_id": job.id, "glm5.lane": job.lane,
        }  # fmt: skip
        if s.HasField("temperature"):
            attributes["gen_ai.request.temperature"] = s.temperature
        # not made the current span: this generator may be closed from another task (a client that left), and
        # detaching a context there fails ("Failed to detach context"); the job carries it to the worker calls
        span = t.tracer.start_span(f"{operation} {self.model_name}", kind=SpanKind.SERVER, attributes=attributes)
        job.trace_context = trace.set_span_in_context(span)
        with span:
            first = last = 0.0
            tokens = 0
            final: worker_pb2.GenerateResponse | None = None
            try:
                async for delta in self._deltas(job, in_reasoning, registry, session):
                    now = time.monotonic()
                    if tokens == 0 and delta.response.token_ids:
                        first = now
                        t.ttft.observe(now - job.arrival)
                    tokens += len(delta.response.token_ids)
                    last = now
                    if delta.response.finish_reason:
                        final = delta.response
                    yield delta
            except BaseException as exc:
                outcome = "cancelled" if isinstance(exc, GeneratorExit | asyncio.CancelledError) else type(exc).__name__
                t.requests.labels(outcome).inc()
                raise
            t.requests.labels("ok").inc()
            if tokens > 1:
                t.tpot.observe((last - first) / (tokens - 1))
            if final is not None:
                u = final.usage
                t.tokens.labels("prompt").inc(u.prompt_tokens)
                t.tokens.labels("completion").inc(u.completion_tokens)
                span.set_attribute("gen_ai.usage.input_tokens", u.prompt_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", u.completion_tokens)
                reason = common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
                span.set_attribute("gen_ai.response.finish_reasons", [reason])
            span.set_attribute("glm5.worker", job.worker)

    async def _deltas(self, job: Job, in_reasoning: bool, registry: ToolRegistry | None,
                      session: str | None) -> AsyncIterator[Delta]:  # fmt: skip
        # chat (a registry, possibly empty): a lone </think> ends reasoning, and tool-call markup is never content
        # (with no tools offered, a call is an error too)
        chat = registry is not None
        reasoning_parser = ReasoningParser(in_reasoning, lone_close=chat, hold_chars=job.lone_close_hold)
        tools = ToolCallParser(registry) if registry is not None else None
        errors = self.dispatcher.telemetry.tool_call_errors
        reasoning_all, content_all = [], []
        async for resp in self._flushed(self._generate(job, reasoning_parser), reasoning_parser, job):
            split = reasoning_parser.feed(resp.text)
            final = resp.finish_reason != 0
            tail = reasoning_parser.finish() if final else None
            reasoning = split.reasoning + (tail.reasoning if tail else "")
            content = split.content + (tail.content if tail else "")
            results: list[ToolCall | ToolCallError] = []
            if tools is not None:
                content, results = tools.feed(content)
                if final:
                    more, late = tools.finish()
                    content, results = content + more, results + late
            reasoning, content = self._clean(reasoning), self._clean(content)
            reasoning_all.append(reasoning)
            content_all.append(content)
            for r in results:
                if isinstance(r, ToolCallError):
                    errors.labels(r.reason).inc()
            yield Delta(resp, "" if job.hide_reasoning else reasoning, content, results)
        if session and reasoning_all and "".join(content_all).strip():
            self.reasoning.put(session, "".join(content_all), "".join(reasoning_all))

    async def _flushed(self, responses: AsyncIterator[worker_pb2.GenerateResponse], parser: ReasoningParser,
                       job: Job) -> AsyncIterator[worker_pb2.GenerateResponse]:  # fmt: skip
        """`responses`; if they fail, first what the parser still holds (text that waited for a lone </think>
        reaches the client before the error, as it would have without the wait)."""
        try:
            async for resp in responses:
                yield resp
        except Exception:
            held = parser.pending()
            if held:
                yield worker_pb2.GenerateResponse(request_id=job.id, text=held)
            raise

    async def _generate(self, job: Job, parser: ReasoningParser) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The worker's stream; with a reasoning budget (light thinking), reasoning that reaches the budget is
        cut: the stream is cancelled and continued from the same tokens plus `</think>`, so the model has to
        answer (budget forcing)."""
        budget = job.reasoning_budget
        if budget is None:
            async for resp in self.submit(job):
                yield resp
            return
        spent, generated, cut = 0, [], False
        async with contextlib.aclosing(self.submit(job)) as stream:
            async for merged in stream:
                # tokens that arrived together are counted one by one where the cut may land inside them
                over = spent + len(merged.token_ids) > budget
                split = over and (parser.in_reasoning or THINK_OPEN in merged.text)
                for resp in per_token(self.tokenizer, merged) if split else [merged]:
                    if parser.in_reasoning:
                        spent += len(resp.token_ids)
                    generated += resp.token_ids
                    yield resp
                    if not resp.finish_reason and parser.in_reasoning and spent >= budget:
                        cut = True
                        break
                if cut:
                    break
        if not cut:
            return  # finished within the budget
        close = self.tokenizer.encode(THINK_CLOSE)
        yield worker_pb2.GenerateResponse(request_id=job.id, token_ids=close, text=THINK_CLOSE)
        left = job.max_new_tokens - len(generated) - len(close)
        request = worker_pb2.GenerateRequest()
        request.CopyFrom(job.request)
        request.prompt_token_ids.extend(generated + close)
        request.sampling.max_new_tokens = max(1, left)
        if request.sampling.HasField("structured_output"):  # the answer starts now: the format from its first token
            request.sampling.structured_output.ClearField("think_open_token_id")
            request.sampling.structured_output.starts_thinking = False
        request.request_id = f"{job.id}-answer"
        cont = Job(request.request_id, request, job.prompt_tokens + len(generated) + len(close), max(1, left),
                   job.lane, job.deadline, job.affinity_key)  # fmt: skip
        async for resp in self.submit(cont):
            if resp.finish_reason:
                resp.usage.prompt_tokens = job.prompt_tokens
                resp.usage.completion_tokens += len(generated) + len(close)
            yield resp
        job.worker = cont.worker

    def _clean(self, text: str) -> str:
        if self._strip is None:
            specials = [t for t in self.tokenizer.special_tokens if t not in STRUCTURAL]
            self._strip = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) or "(?!)")
        return self._strip.sub("", text)


def per_token(tokenizer: Tokenizer, resp: worker_pb2.GenerateResponse) -> list[worker_pb2.GenerateResponse]:
    """`resp` as the one-token responses it merges (usage and finish on the last), or `resp` alone when its
    text is not exactly its tokens' (a delta that caught up on a character split across earlier tokens)."""
    ids = list(resp.token_ids)
    if len(ids) < 2:
        return [resp]
    texts, done = [], ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        if "\ufffd" in text[len(done) :] and k < len(ids):  # inside a UTF-8 character: the next token has it
            texts.append("")
            continue
        if not text.startswith(done):
            return [resp]
        texts.append(text[len(done) :])
        done = text
    if done != resp.text:
        return [resp]
    logprobs = list(resp.logprobs)
    pieces = []
    for k, (token, text) in enumerate(zip(ids, texts, strict=True)):
        piece = worker_pb2.GenerateResponse(request_id=resp.request_id, token_ids=[token], text=text,
                                            weight_version=resp.weight_version)  # fmt: skip
        if k < len(logprobs):
            piece.logprobs.append(logprobs[k])
        pieces.append(piece)
    pieces[0].prompt_logprobs.extend(resp.prompt_logprobs)
    last = pieces[-1]
    last.finish_reason, last.stop_reason = resp.finish_reason, resp.stop_reason
    if resp.HasField("usage"):
        last.usage.CopyFrom(resp.usage)
    return pieces


def _content_chars(m: Any) -> int:
    content = m.get("content") if isinstance(m, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _decode_call(i: int, tc: Any) -> dict[str, Any]:
    """History tool calls carry their arguments as a JSON string (OpenAI); the template wants a mapping."""
    try:
        fn = dict(tc["function"])
        args = fn.get("arguments") or {}
        fn["arguments"] = json.loads(args) if isinstance(args, str) else dict(args)
        return {**tc, "function": fn}
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"messages[{i}].tool_calls", f"expected {{'function': {{'name', 'arguments'}}}}: {exc}"
        ) from exc
