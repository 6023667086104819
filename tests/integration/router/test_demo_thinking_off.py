"""Thinking off on the shipped demo model, which was trained to reason before every answer (its
tokenizer_config.json says `"glm5_thinking_off": "hide"`): the router lets it reason and returns the answer
alone. Before, the template's closed think block made it reason into the answer (`" + 30 + 30 = 52</think>The
answer is 52."` for 12 + 30, and the README's curl body got `</think>` in its content)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from glm5.model.presets import default_model_path

from tests.helpers.procs import start_router, start_worker, stop

MODEL = "glm5-tiny-addition"

INTEGERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": INTEGERS}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    logs = tmp_path_factory.mktemp("thinking-off")
    worker, target = start_worker(default_model_path(), "--kv-cache-bytes", "64MiB", "--max-model-len", "2048",
                                  log=logs / "worker.log")  # fmt: skip
    try:
        router, _, base = start_router([target], log=logs / "router.log")  # thinking policy "auto", the default
        try:
            yield openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
        finally:
            stop(router)
    finally:
        stop(worker)


def _chat(client: openai.OpenAI, content: str, stream: bool, **kw: Any) -> tuple[str | None, str]:
    messages: Any = [{"role": "user", "content": content}]
    if not stream:
        m = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw).choices[0].message
        return (m.model_extra or {}).get("reasoning_content"), m.content or ""
    reasoning, text = "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True, **kw):
        if chunk.choices:
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            text += chunk.choices[0].delta.content or ""
    return reasoning or None, text


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_off_answers_without_its_reasoning(client: openai.OpenAI, stream: bool) -> None:
    off = {"extra_body": {"thinking": {"type": "disabled"}}}
    assert _chat(client, "What is 12 + 30?", stream, **off) == (None, "The answer is 42.")
    reasoning, answer = _chat(client, "hi", stream)  # the README's curl body: "auto" resolves to off
    assert reasoning is None and "</think>" not in answer and "<think>" not in answer
    on = {"extra_body": {"thinking": {"type": "enabled"}}}
    reasoning, answer = _chat(client, "What is 12 + 30?", stream, **on)
    assert reasoning and answer == "The answer is 42."  # on: the same answer, with its reasoning


def test_no_tool_call_markup_reaches_the_content(client: openai.OpenAI) -> None:
    """Only `add` offered, for sums and a product it cannot compute: calls or refused calls, never markup."""
    for question in ("What is 47 + 38?", "What is 51 * 44?", "What is 4821 * 3907?"):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                               tools=[ADD], temperature=0)  # type: ignore[list-item]  # fmt: skip
        content = reply.choices[0].message.content or ""
        assert not any(tag in content for tag in ("<arg_", "</arg_", "tool_call>", "think>")), (question, content)


def test_tool_calls_follow_the_offered_schema_whatever_its_names(client: openai.OpenAI) -> None:
    """tool_choice auto holds each call to the offered tools (the router's lazy tool-call grammar): tools named
    and written as the demo model never saw get calls with their own names and keys, in both formats."""
    lhs_rhs = {"type": "object", "properties": {"lhs": {"type": "integer"}, "rhs": {"type": "integer"}},
               "required": ["lhs", "rhs"]}  # fmt: skip
    tools: Any = [
        {"type": "function", "function": {"name": "sum", "parameters": lhs_rhs}},
        {"type": "function", "function": {"name": "product", "description": "Multiply one value by another one.",
                                          "parameters": lhs_rhs}},
    ]  # fmt: skip
    for a, op, b, name in ((12, "+", 30, "sum"), (7, "*", 6, "product")):
        question = f"What is {a} {op} {b}?"
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                               tools=tools, temperature=0)  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert call.function.name == name  # type: ignore[union-attr]
        assert json.loads(call.function.arguments) == {"lhs": a, "rhs": b}  # type: ignore[union-attr]
        assert not (choice.message.model_extra or {}).get("tool_call_errors")
