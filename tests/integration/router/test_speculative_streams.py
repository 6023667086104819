"""Speculative decoding through the router (issue 36, item 4): a worker that verifies several tokens a step
streams, through reasoning splitting, tool-call parsing and SSE, what a worker that does not streams (only how
many tokens a chunk carries may differ). Two routers in front of two real workers on the shipped demo model (it
thinks, calls tools and answers), one of them drafting with the model's MTP layer (--speculative-config: on a
CPU `auto` does not draft), every request greedy, through the official openai client; structured output and a
required tool call (the router's tool-call grammar) speculate too, each verified row masked by the format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
from glm5.model.presets import SHIPPED_MODEL
from glm5.v1 import worker_pb2, worker_pb2_grpc

from tests.helpers.procs import start_router, start_worker, stop

FLAGS = ("--max-model-len", "2048", "--kv-cache-bytes", "64MiB")
SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
INTEGERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
SUM = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.title()} two integers.",
                                           "parameters": INTEGERS}} for name in ("add", "multiply")]  # fmt: skip


@pytest.fixture(scope="module")
def stacks() -> Iterator[dict[str, Any]]:
    procs: list[Any] = []
    out: dict[str, Any] = {}
    try:
        for name, extra in (("plain", ()), ("speculative", ("--speculative-config", SPEC))):
            worker, target = start_worker(SHIPPED_MODEL, *FLAGS, *extra)
            procs.append(worker)
            router, _, base = start_router([target])
            procs.append(router)
            client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
            out[name] = {"client": client, "worker": target}
        yield out
    finally:
        for p in reversed(procs):
            stop(p)


def _stream(client: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    """A streamed chat completion, field by field: each field's text joined, the chunks that carried any, the
    tool calls assembled from their deltas, and the finish reason."""
    fields: dict[str, str] = {"reasoning_content": "", "content": ""}
    calls: dict[int, dict[str, str]] = {}
    chunks, finish = 0, None
    model = client.models.list().data[0].id
    for chunk in client.chat.completions.create(model=model, temperature=0, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta.model_dump()
        carried = False
        for name in fields:
            if delta.get(name):
                fields[name] += delta[name]
                carried = True
        for call in delta.get("tool_calls") or []:
            slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            fn = call.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
            carried = True
        chunks += carried
        finish = choice.finish_reason or finish
    return {**fields, "tool_calls": [calls[i] for i in sorted(calls)], "finish": finish, "chunks": chunks}


def _accepted(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        stats = worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.GetStatsRequest())
    return stats.speculative.accepted_tokens_total


def test_reasoning_tool_calls_and_answers_stream_as_without_speculation(stacks: dict[str, Any]) -> None:
    plain, spec = stacks["plain"], stacks["speculative"]
    think = {"thinking": {"type": "enabled"}}
    called = {"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 51, "b": 44}'}}
    after_tool = [
        {"role": "user", "content": "What is 51 * 44?"},
        {"role": "assistant", "content": "", "tool_calls": [called]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2244"},
    ]
    requests: dict[str, dict[str, Any]] = {
        # reasoning, then the answer: the split between reasoning_content and content
        "reasoning": dict(messages=[{"role": "user", "content": "What is 347 + 288?"}], max_tokens=200,
                          extra_body=think),
        # a tool call, its arguments streamed
        "tool call": dict(messages=[{"role": "user", "content": "What is 51 * 44?"}], tools=TOOLS, max_tokens=200),
        # the answer after the tool's result
        "after the tool": dict(messages=after_tool, tools=TOOLS, max_tokens=200),
        # a JSON schema: every verified row masked by the format as it stands after the drafts before it
        "schema": dict(messages=[{"role": "user", "content": "What is 12 + 30?"}], max_tokens=60,
                       response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": SUM}}),
        # a tool call the router's grammar requires
        "required tool": dict(messages=[{"role": "user", "content": "What is 7 + 5?"}], tools=TOOLS,
                              tool_choice="required", max_tokens=120),
        # thinking, cut by the length limit inside it
        "cut": dict(messages=[{"role": "user", "content": "What is 347 + 288?"}], max_tokens=6,
                    extra_body=think),
    }  # fmt: skip
    streams, accepted = {}, {}
    for name, kw in requests.items():
        before = _accepted(spec["worker"])
        want, got = _stream(plain["client"], **kw), _stream(spec["client"], **kw)
        assert {k: v for k, v in got.items() if k != "chunks"} == {k: v for k, v in want.items() if k != "chunks"}, name
        assert got["chunks"] > 0, name
        streams[name], accepted[name] = want, _accepted(spec["worker"]) - before
    # the requests took the paths they are here for
    assert streams["reasoning"]["reasoning_content"] and streams["reasoning"]["content"]
    assert [c["name"] for c in streams["tool call"]["tool_calls"]] == ["multiply"]
    assert "2244" in streams["after the tool"]["content"]
    assert streams["cut"]["finish"] == "length" and streams["cut"]["reasoning_content"]
    assert set(json.loads(streams["schema"]["content"])) == {"sum"}
    (required,) = streams["required tool"]["tool_calls"]
    assert set(json.loads(required["arguments"])) == {"a", "b"}
    # several tokens did arrive in one step: the streams were really speculative, the formatted ones too
    assert sum(accepted.values()) > 0 and accepted["schema"] > 0 and accepted["required tool"] > 0, accepted
