"""Structured output in the engine: what the format allows is all that is generated, whatever the model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from glm5.errors import InvalidRequestError
from glm5.model.presets import init_model
from glm5_worker.config import EngineConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import FinishReason, SamplingParams
from glm5_worker.engine.structured import OutputFormat

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 200}, "sign": {"enum": ["+", "-"]}},
    "required": ["answer", "sign"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = init_model(tmp_path_factory.mktemp("structured") / "m", preset="tiny-shallow", seed=0)
    return Engine(EngineConfig(model=str(Path(path)), max_model_len=512, kv_cache_bytes=16 << 20, block_size=16))


def run(engine: Engine, requests: dict[str, SamplingParams], prompt: str = "1 2 3") -> dict[str, tuple[str, list]]:
    for rid, params in requests.items():
        engine.add_request(rid, prompt, None, params)
    text: dict[str, str] = {rid: "" for rid in requests}
    last: dict[str, list] = {}
    while engine.has_work:
        for out in engine.step():
            text[out.request_id] += out.text
            if out.finish_reason != FinishReason.NONE:
                last[out.request_id] = [out.finish_reason, out.stop_reason]
    return {rid: (text[rid], last[rid]) for rid in requests}


def params(fmt: OutputFormat | None, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_new_tokens": 60, "output_format": fmt, **kw})


def test_json_schema_regex_and_grammar_constrain_a_random_model(engine: Engine) -> None:
    out = run(engine, {
        "schema": params(OutputFormat("json_schema", json.dumps(SCHEMA))),
        "regex": params(OutputFormat("regex", r"[0-9]{3}-[a-z]{2}")),
        "lark": params(OutputFormat("lark_grammar", 'start: "yes" | "no"')),
        "sampled": params(OutputFormat("json_schema", json.dumps(SCHEMA)), temperature=1.0, seed=3),
        "free": params(None, max_new_tokens=8),
    })  # fmt: skip
    for rid in ("schema", "sampled"):
        text, (finish, reason) = out[rid]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert (finish, reason) == (FinishReason.STOP, "structured_output")
        assert text == json.dumps(json.loads(text))  # compact, json.dumps' separators
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out["regex"][0])
    assert out["lark"][0] in ("yes", "no")
    # the constrained rows of the batch leave the free one alone
    assert out["free"][0] == run(engine, {"alone": params(None, max_new_tokens=8)})["alone"][0]
    json_object = run(engine, {"o": params(OutputFormat("json_object"), max_new_tokens=8)})["o"][0]
    assert json_object.startswith("{")


def test_a_thinking_block_stays_free(engine: Engine) -> None:
    """The format applies after a leading thinking block: one the prompt left open (starts_thinking), or one
    the output opens; an output that does not open one is held to the format from its first token."""
    free = engine.tokenizer.encode(run(engine, {"f": params(None, max_new_tokens=3)})["f"][0])
    head = engine.tokenizer.decode(free[:2])
    regex = r"[0-9]{4}"
    out = run(engine, {
        # the prompt ended inside a block that the model's second token closes
        "open": params(OutputFormat("regex", regex, think_close=free[1], starts_thinking=True)),
        # the model's own first token opens the block (greedy: it is its most likely token, allowed at the start)
        "opens": params(OutputFormat("regex", regex, think_open=free[0], think_close=free[1])),
        # a block opener the model does not pick: the format from the first token
        "direct": params(OutputFormat("regex", regex, think_open=free[2] + 1 if free[2] + 1 != free[0] else free[2] + 2,
                                      think_close=free[1])),
    })  # fmt: skip
    for rid in ("open", "opens"):
        text = out[rid][0]
        assert text.startswith(head) and re.fullmatch(regex, text[len(head) :]), (rid, text)
    assert re.fullmatch(regex, out["direct"][0])


def test_logprobs_stay_the_models(engine: Engine) -> None:
    """A forced token's logprob is the model's own (usually low), not 0 from the masked distribution."""
    p = params(OutputFormat("lark_grammar", 'start: "zzz"'), logprobs=True)
    engine.add_request("lp", "1 2 3", None, p)
    logprobs, text = [], ""
    while engine.has_work:
        for o in engine.step():
            logprobs += [x.logprob for x in o.logprobs]
            text += o.text
    assert text == "zzz" and logprobs and all(lp < -0.01 for lp in logprobs)


@pytest.mark.parametrize(
    ("fmt", "match"),
    [
        (OutputFormat("json_schema", "{not json"), "json_schema"),
        (OutputFormat("json_schema", '{"type": "frobnicate"}'), "json_schema"),
        (OutputFormat("regex", "[unclosed"), "regex"),
        (OutputFormat("lark_grammar", "start: undefined_rule"), "lark_grammar"),
        (OutputFormat("regex", "a", think_open=3, think_close=10**7), "think_close_token_id"),
        (OutputFormat("regex", "a", starts_thinking=True), "think_close_token_id"),
    ],
)
def test_bad_formats_are_the_requests_error(engine: Engine, fmt: OutputFormat, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as err:
        engine.add_request("bad", "1 2 3", None, params(fmt))
    assert err.value.field == "sampling.structured_output"
    assert "bad" not in engine.requests and not engine.has_work  # nothing half-added
