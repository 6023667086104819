"""The router process in front of two real `glm5 worker` processes (tiny model): the OpenAI API with the
official client, sealed SM4-GCM gRPC requests, and a worker killed under load."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from glm5.client import sampling
from glm5.crypto.envelopes import open_stream_message, seal_request
from glm5.crypto.sm4 import KeyRing, StreamOpener
from glm5.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2

from tests.helpers.procs import start_router, start_worker, stop

WORKER_FLAGS = ("--max-model-len", "2048", "--kv-cache-bytes", "64MiB", "--max-num-seqs", "8")
KEY = bytes.fromhex("00112233445566778899aabbccddeeff")


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("router-real")
    keys = tmp / "keys"
    keys.mkdir()
    (keys / "k1").write_text(KEY.hex())
    workers = [start_worker(tiny_model, *WORKER_FLAGS) for _ in range(2)]
    router, target, base = start_router([t for _, t in workers], "--sm4-key-dir", str(keys), "--light-thinking-budget",
                                        "16", log=tmp / "router.log")  # fmt: skip
    try:
        yield {"grpc": target, "base": base, "workers": [t for _, t in workers]}
    finally:
        stop(router)
        for p, _ in workers:
            stop(p)


def test_openai_chat_stream_matches_whole_and_reports_usage(stack: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=stack["base"], api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    whole = client.chat.completions.create(model="glm5-tiny", messages=messages, max_tokens=24,  # type: ignore[arg-type]
                                           temperature=0, extra_body={"thinking": {"type": "disabled"}})  # fmt: skip
    parts, usage = [], None
    for chunk in client.chat.completions.create(
        model="glm5-tiny", messages=messages, max_tokens=24, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"thinking": {"type": "disabled"}},
    ):  # fmt: skip
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content  # greedy: same tokens either way
    assert whole.usage is not None and usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens > 0
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 5
    completion = client.completions.create(model="glm5-tiny", prompt="1 2 3 4", max_tokens=8, temperature=0)
    assert completion.usage is not None and completion.usage.completion_tokens <= 8


def test_openai_logprobs_and_echo(stack: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=stack["base"], api_key="none", max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(model="glm5-tiny", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                              max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
                              extra_body={"thinking": {"type": "disabled"}})  # fmt: skip
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].logprobs is not None and whole.usage is not None
    entries = whole.choices[0].logprobs.content or []
    assert len(entries) == whole.usage.completion_tokens > 0  # one per generated token
    for e in entries:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        # greedy: the chosen token is the most likely one
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    streamed = [
        e.token
        for chunk in client.chat.completions.create(**kw, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content or []
    ]
    assert streamed == [e.token for e in entries]

    prompt = "1 2 3 4"
    plain = client.completions.create(model="glm5-tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
    echoed = client.completions.create(model="glm5-tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                                       echo=True)  # fmt: skip
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    lp, lp_plain = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert lp is not None and lp_plain is not None and echoed.usage is not None
    tokens, offsets = lp.tokens or [], lp.text_offset or []
    assert len(tokens) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens
    assert "".join(tokens) == echoed.choices[0].text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert (lp.token_logprobs or [])[0] is None and all(x <= 0 for x in (lp.token_logprobs or [])[1:])
    # the generated part is what the request without echo got: the same tokens; logprobs to float32's precision,
    # since echo computes logits for every prompt row (lm_head over n rows instead of one rounds differently:
    # ~5e-7 on this model, measured)
    n = echoed.usage.prompt_tokens
    assert tokens[n:] == lp_plain.tokens
    assert (lp.token_logprobs or [])[n:] == pytest.approx(lp_plain.token_logprobs, rel=1e-6, abs=1e-6)


def test_openai_penalties_reach_the_sampler(stack: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=stack["base"], api_key="none", max_retries=0, timeout=120)

    def tokens(**kw: Any) -> list[str]:
        out = client.completions.create(model="glm5-tiny", prompt="1 2 3 4", max_tokens=12, temperature=0,
                                        logprobs=0, **kw)  # fmt: skip
        assert out.choices[0].logprobs is not None
        return out.choices[0].logprobs.tokens or []

    plain, penalised = tokens(), tokens(frequency_penalty=2.0, presence_penalty=2.0)
    most = max(set(plain), key=plain.count)
    assert plain.count(most) > 2  # the demo model repeats itself on this prompt
    assert penalised.count(most) < plain.count(most)
    assert max(penalised.count(t) for t in set(penalised)) < plain.count(most)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        tokens(frequency_penalty=2.5)
    # logit_bias: +100 forces a token the model would not pick, -100 bans the one it would
    forced = tokens(logit_bias={"16": 100})
    assert len(set(forced)) == 1 and forced[0] not in plain
    banned = _token_ids(stack["base"], most)
    assert len(banned) == 1 and most not in tokens(logit_bias={str(banned[0]): -100})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        tokens(logit_bias={"sixteen": 1})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        tokens(logit_bias={"16": 101})


def _token_ids(base: str, text: str) -> list[int]:
    request = urllib.request.Request(base.removesuffix("/v1") + "/tokenize", data=json.dumps({"prompt": text}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        return list(json.load(response)["tokens"])


def test_openai_n_choices(stack: dict[str, Any]) -> None:
    """`n` choices are requests of their own with seeds seed + i: the same as n single requests, whole or
    streamed, with the prompt counted once in the usage."""
    client = openai.OpenAI(base_url=stack["base"], api_key="none", max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(model="glm5-tiny", messages=[{"role": "user", "content": "What is 17 + 25?"}],
                              max_tokens=10, temperature=1.5, logprobs=True,
                              extra_body={"thinking": {"type": "disabled"}})  # fmt: skip
    many = client.chat.completions.create(**kw, n=3, seed=7)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(**kw, seed=7 + i) for i in range(3)]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in many.choices}) > 1  # sampled at 1.5 with different seeds
    assert many.usage is not None and singles[0].usage is not None
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(len(c.logprobs.content or []) for c in many.choices if c.logprobs)

    texts, finishes, usage = ["", "", ""], [None, None, None], None
    for chunk in client.chat.completions.create(**kw, n=3, seed=7, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = finishes[c.index] or c.finish_reason
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in many.choices]
    assert finishes == [c.finish_reason for c in many.choices]
    assert usage is not None and usage.completion_tokens == many.usage.completion_tokens

    completions = client.completions.create(model="glm5-tiny", prompt="1 2", max_tokens=4, n=2, echo=True, seed=3)
    assert [c.index for c in completions.choices] == [0, 1]
    assert all(c.text.startswith("1 2") for c in completions.choices)
    # a batch of prompts: choice index = prompt index * n + choice; each prompt counted once in the usage
    prompts: list[Any] = ["1 2", [16, 17, 18]]
    greedy: dict[str, Any] = dict(model="glm5-tiny", max_tokens=3, echo=True, temperature=0)
    batch = client.completions.create(prompt=prompts, n=2, **greedy)
    alone = [client.completions.create(prompt=p, **greedy) for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage is not None and alone[0].usage is not None and alone[1].usage is not None
    assert batch.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="prompts x n"):
        client.completions.create(model="glm5-tiny", prompt=["1"] * 9, max_tokens=1, n=8)
    for bad in (0, 65):
        with pytest.raises(openai.BadRequestError, match="n: must be in 1..64"):
            client.completions.create(model="glm5-tiny", prompt="1 2", max_tokens=4, n=bad)


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 200}, "unit": {"enum": ["apples", "pears"]}},
    "required": ["answer", "unit"],
    "additionalProperties": False,
}


def test_openai_structured_output(stack: dict[str, Any]) -> None:
    """response_format and vLLM's guided_* hold a random-weight model to the format."""
    client = openai.OpenAI(base_url=stack["base"], api_key="none", max_retries=0, timeout=120)
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    json_format = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}
    off = {"thinking": {"type": "disabled"}}
    reply = client.chat.completions.create(model="glm5-tiny", messages=user, max_tokens=40,  # type: ignore[arg-type]
                                           response_format=json_format, extra_body=off)  # type: ignore[arg-type]  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    # thinking stays free, the answer after it is held to the format: with thinking on, and after a prompt
    # that opens a thinking block (which the bias closes at once: the random model would not)
    reply = client.chat.completions.create(model="glm5-tiny", messages=user, max_tokens=40,  # type: ignore[arg-type]
                                           response_format=json_format, extra_body={"thinking": {"type": "enabled"}})  # type: ignore[arg-type]  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)
    think_close = _token_ids(stack["base"], "</think>")
    bias = {str(think_close[0]): 100}
    raw = client.completions.create(model="glm5-tiny", prompt="What is 2 + 3?<think>", max_tokens=40, temperature=0,
                                    logit_bias=bias, extra_body={"guided_json": SCHEMA})  # fmt: skip
    assert raw.choices[0].text.startswith("</think>")
    jsonschema.validate(json.loads(raw.choices[0].text.removeprefix("</think>")), SCHEMA)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(model="glm5-tiny", messages=user, max_tokens=40, stream=True,  # type: ignore[arg-type]
                                                    response_format={"type": "json_object"}, extra_body=off)  # type: ignore[arg-type]
        if chunk.choices
    )  # fmt: skip
    assert streamed.startswith("{")
    choice = client.completions.create(model="glm5-tiny", prompt="1 2", max_tokens=10,
                                       extra_body={"guided_choice": ["yes", "no", "maybe so"]})  # fmt: skip
    assert choice.choices[0].text in ("yes", "no", "maybe so")
    regex = client.completions.create(
        model="glm5-tiny", prompt="1 2", max_tokens=10, extra_body={"guided_regex": "[a-c]{4}"}
    )
    assert re.fullmatch("[a-c]{4}", regex.choices[0].text)
    for kw, match in (
        (dict(extra_body={"guided_regex": "[oops"}), "structured_output"),
        (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "one output format"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "schema"),
        (dict(response_format={"type": "xml"}), "response_format"),
    ):
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(model="glm5-tiny", messages=user, max_tokens=5, **kw)  # type: ignore[arg-type]


CITY = {"type": "string", "maxLength": 12}
DAYS = {"type": "integer", "minimum": 1, "maximum": 9}
WEATHER_ARGS = {"type": "object", "required": ["city"], "properties": {"city": CITY, "days": DAYS}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def test_openai_tool_choice_required_and_named(stack: dict[str, Any]) -> None:
    """tool_choice 'required' / a named function: the random model's answer is held to the tool-call format."""
    client = openai.OpenAI(base_url=stack["base"], api_key="none", max_retries=0, timeout=120)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [WEATHER, CLOCK]
    named = {"type": "function", "function": {"name": "get_weather"}}
    close = {str(_token_ids(stack["base"], "</think>")[0]): 100}  # ends a thinking block the random model opens
    for thinking in ("disabled", "enabled"):
        reply = client.chat.completions.create(model="glm5-tiny", messages=user, tools=tools, tool_choice=named,  # type: ignore[arg-type]
                                               max_tokens=60, logit_bias=close,  # type: ignore[arg-type]
                                               extra_body={"thinking": {"type": thinking}})  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (thinking, choice)
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
        jsonschema.validate(arguments, WEATHER_ARGS)
    reply = client.chat.completions.create(model="glm5-tiny", messages=user, tools=tools, tool_choice="required",  # type: ignore[arg-type]
                                           max_tokens=60, extra_body={"thinking": {"type": "disabled"}})  # fmt: skip
    calls = reply.choices[0].message.tool_calls or []
    assert calls and {c.function.name for c in calls} <= {"get_weather", "now"}  # type: ignore[union-attr]
    for choice, match in (
        ({"type": "function", "function": {"name": "nope"}}, "no tool named"),
        ("always", "tool_choice"),
    ):
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(model="glm5-tiny", messages=user, tools=tools, tool_choice=choice)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="glm5-tiny", messages=user, tool_choice="required")  # type: ignore[arg-type]


def test_light_thinking_cut_at_its_budget_then_answers(stack: dict[str, Any]) -> None:
    """Budget forcing on real workers: the reasoning is cut at 16 tokens and the answer continues in a second
    worker request, held to the response format from its first token."""
    client = openai.OpenAI(base_url=stack["base"], api_key="none", max_retries=0, timeout=120)
    # the random model opens its reasoning at once and never ends it itself
    bias = {str(_token_ids(stack["base"], "<think>")[0]): 100, str(_token_ids(stack["base"], "</think>")[0]): -100}
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    for fmt in (None, {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}):
        extra = {"response_format": fmt} if fmt else {}
        reply = client.chat.completions.create(model="glm5-tiny", messages=user, max_tokens=60, reasoning_effort="low",  # type: ignore[arg-type]
                                               logit_bias=bias, **extra)  # fmt: skip
        assert reply.usage is not None and reply.usage.completion_tokens > 17  # 16 + </think> + the answer
        if fmt:
            jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)


def test_load_spreads_over_both_workers(stack: dict[str, Any]) -> None:
    async def one(stub: router_pb2_grpc.RouterStub, i: int) -> str:
        req = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
            prompt=f"count {i}", sampling=sampling(max_new_tokens=16, ignore_eos=True)))  # fmt: skip
        workers = {r.worker async for r in stub.Generate(req, timeout=120)}
        (worker,) = workers
        return worker

    async def go() -> set[str]:
        async with grpc.aio.insecure_channel(stack["grpc"]) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            return set(await asyncio.gather(*(one(stub, i) for i in range(8))))

    assert asyncio.run(go()) == set(stack["workers"])


def test_sealed_requests_and_responses(stack: dict[str, Any]) -> None:
    ring = KeyRing({"k1": KEY})
    inner = worker_pb2.GenerateRequest(prompt="secret prompt", sampling=sampling(max_new_tokens=6, temperature=0))

    async def go() -> tuple[str, list[router_pb2.RouterGenerateResponse]]:
        async with grpc.aio.insecure_channel(stack["grpc"]) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            req = seal_request(ring, router_pb2.RouterGenerateRequest(request=inner), "r-sealed")
            sealed = [r async for r in stub.Generate(req, timeout=120)]
            plain = [r async for r in stub.Generate(router_pb2.RouterGenerateRequest(request=inner), timeout=120)]
            return "".join(r.response.text for r in plain), sealed

    plain_text, sealed = asyncio.run(go())
    assert all(not r.HasField("response") and r.sealed.ciphertext for r in sealed)
    opener = StreamOpener(ring, "r-sealed")
    opened = [open_stream_message(opener, r.sealed, router_pb2.RouterGenerateResponse) for r in sealed]
    assert "".join(o.response.text for o in opened) == plain_text  # greedy: the same answer, encrypted
    assert opened[-1].response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    async def bad(req: router_pb2.RouterGenerateRequest) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(stack["grpc"]) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=30):
                    pass
            return err.value

    routed = router_pb2.RouterGenerateRequest(request=inner)
    env = seal_request(ring, routed, "r-2").sealed
    wrong_key = seal_request(KeyRing({"k1": bytes(16)}), routed, "r-2").sealed
    tampered = router_pb2.Envelope(
        key_id=env.key_id, nonce=env.nonce, ciphertext=bytes([env.ciphertext[0] ^ 1]) + env.ciphertext[1:]
    )
    for req, message in [
        (router_pb2.RouterGenerateRequest(request_id="r-2", sealed=tampered), "authentication failed"),
        (router_pb2.RouterGenerateRequest(request_id="r-other", sealed=env), "authentication failed"),
        (router_pb2.RouterGenerateRequest(sealed=env), "request_id"),
        (router_pb2.RouterGenerateRequest(request_id="r-2", sealed=wrong_key), "authentication failed"),
        (router_pb2.RouterGenerateRequest(request_id="r-2", sealed=env, request=inner), "outside the envelope"),
    ]:  # fmt: skip
        err = asyncio.run(bad(req))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (err.details() or "")


def test_bad_sampling_is_invalid_argument(stack: dict[str, Any]) -> None:
    async def go() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(stack["grpc"]) as ch:
            req = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
                prompt="x", sampling=sampling(max_new_tokens=4, top_p=1.5)))  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=30):
                    pass
            return err.value

    err = asyncio.run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in (err.details() or "")


def test_worker_killed_under_load(tiny_model: Path, tmp_path: Path) -> None:
    a_proc, a = start_worker(tiny_model, *WORKER_FLAGS)
    b_proc, b = start_worker(tiny_model, *WORKER_FLAGS)
    router, target, _ = start_router([a, b], "--breaker-min-calls", "2", "--breaker-open-seconds", "1",
                                        "--retry-backoff-ms", "20", log=tmp_path / "router.log")  # fmt: skip

    async def stream(
        stub: router_pb2_grpc.RouterStub, i: int, n: int, kill: asyncio.Event | None
    ) -> tuple[str, int, str]:
        req = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
            prompt=f"load {i}", sampling=sampling(max_new_tokens=n, ignore_eos=True)))  # fmt: skip
        worker, tokens = "", 0
        try:
            async for r in stub.Generate(req, timeout=300):
                worker, tokens = r.worker, tokens + len(r.response.token_ids)
                if kill is not None and worker == a and tokens >= 4:
                    kill.set()
            return worker, tokens, "ok"
        except grpc.aio.AioRpcError as exc:
            return worker, tokens, f"{exc.code().name}: {exc.details()}"

    async def go() -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            kill = asyncio.Event()
            running = [asyncio.create_task(stream(stub, i, 400, kill)) for i in range(4)]
            await asyncio.wait_for(kill.wait(), 120)
            os.kill(a_proc.pid, signal.SIGKILL)  # mid-stream on worker a
            after = await asyncio.gather(*(stream(stub, 10 + i, 8, None) for i in range(6)))
            return list(await asyncio.gather(*running)), list(after)

    try:
        under_load, after = asyncio.run(go())
        broken = [r for r in under_load if r[0] == a]
        assert broken and all(r[2].startswith("UNAVAILABLE") and "mid-stream" in r[2] and r[1] > 0 for r in broken)
        assert all(r == (b, 400, "ok") for r in under_load if r[0] == b)
        # Requests sent after the kill, none of which had a token yet: all complete on the other worker.
        assert all(r == (b, 8, "ok") for r in after), after
        a_proc.wait(10)
        a_proc, _ = start_worker(tiny_model, *WORKER_FLAGS, port=int(a.rsplit(":", 1)[1]))  # a comes back
        deadline = time.monotonic() + 60
        served_by_a = False
        while time.monotonic() < deadline and not served_by_a:
            results = asyncio.run(_burst(target, 4))
            served_by_a = a in {w for w, _, _ in results}
            assert all(status == "ok" for _, _, status in results)
        assert served_by_a, "the restarted worker never came back into rotation"
    finally:
        stop(router)
        stop(a_proc)
        stop(b_proc)


async def _burst(target: str, n: int) -> list[tuple[str, int, str]]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = router_pb2_grpc.RouterStub(ch)

        async def one(i: int) -> tuple[str, int, str]:
            req = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
                prompt=f"back {i}", sampling=sampling(max_new_tokens=4, ignore_eos=True)))  # fmt: skip
            worker = ""
            async for r in stub.Generate(req, timeout=60):
                worker = r.worker
            return worker, 4, "ok"

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_a_worker_drained_by_sigterm_finishes_its_streams_and_gets_no_new_ones(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A scale-down or a rolling update: SIGTERM. The worker says it is draining in its stats; the router stops
    picking it at its next poll, and every request, those it was running included, completes."""
    a_proc, a = start_worker(tiny_model, *WORKER_FLAGS)
    b_proc, b = start_worker(tiny_model, *WORKER_FLAGS)
    router, target, base = start_router([a, b], "--routing", "load", log=tmp_path / "router.log")

    async def stream(stub: router_pb2_grpc.RouterStub, i: int, n: int, seen: asyncio.Event | None) -> tuple[str, int]:
        req = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
            prompt=f"drain {i}", sampling=sampling(max_new_tokens=n, ignore_eos=True)))  # fmt: skip
        worker, tokens = "", 0
        async for r in stub.Generate(req, timeout=120):
            worker, tokens = r.worker, tokens + len(r.response.token_ids)
            if seen is not None and worker == a and tokens >= 4:
                seen.set()
        return worker, tokens

    async def go() -> tuple[list[tuple[str, int]], list[tuple[str, int]], str, str]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            seen = asyncio.Event()
            running = [asyncio.create_task(stream(stub, i, 200, seen)) for i in range(4)]
            await asyncio.wait_for(seen.wait(), 120)
            a_proc.send_signal(signal.SIGTERM)  # mid-stream on worker a
            await asyncio.sleep(2.5)  # the router's poll (1 s) sees it draining
            metrics = await asyncio.to_thread(
                lambda: urllib.request.urlopen(base.removesuffix("/v1") + "/metrics").read().decode()
            )
            after = await asyncio.gather(*(stream(stub, 10 + i, 8, None) for i in range(6)))
            done = list(await asyncio.gather(*running))
            metrics_after = await asyncio.to_thread(
                lambda: urllib.request.urlopen(base.removesuffix("/v1") + "/metrics").read().decode()
            )
            return done, list(after), metrics, metrics_after

    try:
        under_load, after, metrics, metrics_after = asyncio.run(go())
        assert {w for w, _ in under_load} == {a, b} and all(n == 200 for _, n in under_load), under_load
        assert all(r == (b, 8) for r in after), after
        assert re.search(rf'glm5_worker_draining\{{worker="{re.escape(a)}"\}} 1\.0', metrics), metrics
        assert "glm5_router_retries_total 0.0" in metrics_after  # never sent to the draining worker and refused there
        assert a_proc.wait(60) == 0  # it exited by itself once its streams had finished
    finally:
        stop(router)
        stop(a_proc)
        stop(b_proc)
