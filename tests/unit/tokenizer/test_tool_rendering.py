"""How a chat template writes the offered tools (glm5.tokenizer.build.TOOL_RENDERINGS): "json" is GLM-5's own
(each definition as JSON), "signatures" (the demo model's) writes `name(param, ...)` in the schema's order, so two
schemas that differ only in types, descriptions or schema keywords give the same prompt, and parameter names and
order (what a call must copy) still show. A special token's text in a tool's or parameter's name stays text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from glm5.tokenizer import Tokenizer
from glm5.tokenizer.build import CHAT_TEMPLATE, chat_template

QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


def _tool(name: str, params: list[str], **extra: object) -> dict[str, object]:
    schema: dict[str, object] = {"type": "object", "properties": {p: {"type": "integer"} for p in params}, **extra}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


@pytest.fixture(scope="module")
def signatures(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("signatures")
    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template("signatures")}))
    (out / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    return Tokenizer(out)


def test_the_json_rendering_is_the_shipped_template() -> None:
    assert chat_template("json") == CHAT_TEMPLATE
    assert "{{ tool | tojson }}" in CHAT_TEMPLATE and "{TOOLS}" not in CHAT_TEMPLATE


def test_signatures_keep_names_and_order_and_drop_the_rest(signatures: Tokenizer) -> None:
    tools = [_tool("add", ["x", "y"]), _tool("get_time", ["timezone"]), _tool("ping", [])]
    text = signatures.apply_chat_template(QUESTION, tools=tools, add_generation_prompt=True)
    assert "<tools>\nadd(x, y)\nget_time(timezone)\nping()\n</tools>\n" in text
    reordered = signatures.apply_chat_template(QUESTION, tools=[_tool("add", ["y", "x"])], add_generation_prompt=True)
    assert "<tools>\nadd(y, x)\n</tools>" in reordered
    # a function without any parameters key, and one written without the "function" wrapper
    bare = signatures.apply_chat_template(QUESTION, tools=[{"type": "function", "function": {"name": "now"}},
                                                           {"name": "later", "parameters": {}}])  # fmt: skip
    assert "<tools>\nnow()\nlater()\n</tools>" in bare


def test_schemas_written_differently_give_one_prompt(signatures: Tokenizer) -> None:
    plain = [_tool("add", ["a", "b"])]
    written = [
        _tool("add", ["a", "b"], additionalProperties=False, required=["a", "b"]),
        {"type": "function", "function": {"name": "add", "description": "Add two integers.", "strict": True,
         "parameters": {"title": "AddArgs", "type": "object", "required": ["b", "a"],
                        "properties": {"a": {"type": "number", "title": "A", "description": "The first number."},
                                       "b": {"type": "number", "title": "B"}}}}},
    ]  # fmt: skip
    want = signatures.encode_chat(QUESTION, 4096, tools=plain, add_generation_prompt=True)
    for tool in written:
        assert signatures.encode_chat(QUESTION, 4096, tools=[tool], add_generation_prompt=True) == want


def test_special_token_text_in_a_signature_stays_text(signatures: Tokenizer) -> None:
    ids, text = signatures.encode_chat(QUESTION, 4096, tools=[_tool("add<|assistant|>", ["a</think>", "b"])],
                                       add_generation_prompt=True)  # fmt: skip
    assert "add<|assistant|>(a</think>, b)" in text
    specials = [str(signatures.id_to_token(i)) for i in ids if signatures.is_special(i)]
    assert specials.count("<|assistant|>") == 1 and "</think>" not in specials  # only the generation prompt's
