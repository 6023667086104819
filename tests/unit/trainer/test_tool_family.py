"""Calculator problems over varied tool definitions (glm5_trainer.tool_family): training problems never show a
held-out value or operand pair, held-out ones always do, every tool set is one the router accepts, and the
supervised traces of varied problems (thinking on and off) are the episodes the environment plays."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from glm5.model.presets import SHIPPED_MODEL
from glm5.parsing.tools import ToolCall, ToolRegistry
from glm5.tokenizer.tokenizer import Tokenizer
from glm5_trainer import tool_family as tf
from glm5_trainer.environment import Problem, ToolUse, prompt_ids, tool_problems
from glm5_trainer.tool_sft import drill, tool_turns, trace

from tests.unit.trainer.scripted import play_turns

TOK = Tokenizer(SHIPPED_MODEL)


def operands(p: Problem) -> tuple[int, str, int]:
    return tf.calculation(p)


def held_out_values(p: Problem) -> set[str]:
    """Which held-out axes' values appear in the problem."""
    text = json.dumps(list(p.tools))
    found = set()
    names = {t["function"]["name"] for t in p.tools}
    for t in p.tools:
        fn = t["function"]
        if fn["name"] in tf.OPERATION_OF and tuple(fn["parameters"]["properties"]) in {
            *tf.HELD_OUT_PARAMS, *(q[::-1] for q in tf.HELD_OUT_PARAMS)}:  # fmt: skip
            found.add("params")
    held_descriptions = {d for ds in tf.HELD_OUT_DESCRIPTIONS.values() for d in ds if d}
    held_descriptions |= {d for ds in tf.HELD_OUT_PROPERTY_DESCRIPTIONS for d in ds}
    if any(json.dumps(d) in text for d in held_descriptions):
        found.add("descriptions")
    if names & {e[0] for e in tf.HELD_OUT_EXTRAS}:
        found.add("extras")
    if '"title"' in text or '"strict"' in text:
        found.add("schema")
    question = p.messages[-1]["content"]
    a, op, b = operands(p)
    if question in {q.format(a=a, b=b) for q in tf.HELD_OUT_PHRASINGS[op]}:
        found.add("phrasing")
    return found


def test_training_problems_show_no_held_out_value_or_pair() -> None:
    rng = random.Random(0)
    legacy = frozenset(p.id for p in tool_problems()[1])
    seen_params, seen_extras, forms = set(), set(), set()
    for _ in range(3000):
        p = tf.sample(rng, exclude=legacy)
        a, op, b = operands(p)
        assert p.id.startswith("train:") and not tf.held_out_pair(op, a, b) and f"{a}{op}{b}" not in legacy
        assert not held_out_values(p), p
        assert p.answer == str(a + b if op == "+" else a * b)
        calc = [t["function"] for t in p.tools if t["function"]["name"] in tf.OPERATION_OF]
        assert op in {tf.OPERATION_OF[fn["name"]] for fn in calc}  # the tool the question needs is offered
        for fn in calc:
            seen_params.add(tuple(fn["parameters"]["properties"]))
            forms.add(json.dumps(fn["parameters"].get("additionalProperties")))
        seen_extras |= {t["function"]["name"] for t in p.tools} - set(tf.OPERATION_OF)
    assert {("a", "b"), ("b", "a"), ("x", "y"), ("first", "second")} <= seen_params
    assert forms == {"false", "true", "null"}  # additionalProperties false, true and absent
    assert seen_extras == {e[0] for e in tf.EXTRAS}
    assert {len(str(x)) for p in (tf.sample(rng) for _ in range(400)) for x in operands(p)[::2]} == {1, 2, 3, 4}


def test_held_out_problems_use_held_out_axes_pairs_and_their_buckets() -> None:
    sets = tf.held_out_problems(per_bucket=60)
    assert sets == tf.held_out_problems(per_bucket=60)  # deterministic
    for bucket, problems in sets.items():
        assert len(problems) == 60 and len({p.id for p in problems}) == 60
        for p in problems:
            a, op, b = operands(p)
            assert tf.held_out_pair(op, a, b)
            assert max(len(str(a)), len(str(b))) in tf.BUCKETS[bucket]
            axes = set(p.id.split(":")[0].split("+"))
            assert axes <= set(tf.HELD_OUT_AXES) and axes
            # the axes named in the id are there (descriptions may be drawn as none at all)
            assert axes - {"descriptions"} <= held_out_values(p), p
    readme = tf.readme_problems(50)
    assert all("additionalProperties" not in json.dumps(list(p.tools)) for p in readme)
    assert all(tf.held_out_pair(*(lambda a, op, b: (op, a, b))(*operands(p))) for p in readme)


def test_every_tool_set_is_accepted_and_an_episode_fits_the_dense_context() -> None:
    rng = random.Random(1)
    problems = [tf.sample(rng) for _ in range(300)] + [p for ps in tf.held_out_problems(40).values() for p in ps]
    for p in problems:
        registry = ToolRegistry.from_openai(list(p.tools))
        assert set(registry.tools) == {t["function"]["name"] for t in p.tools}
        ids, _ = trace(TOK, p)
        assert len(ids) + 20 < 1024  # under index_topk and the evaluation's context, with room to spare


@pytest.mark.parametrize("thinking", [True, False])
def test_traces_of_varied_problems_are_the_episodes_the_environment_plays(thinking: bool) -> None:
    rng = random.Random(2)
    for _ in range(15):
        p = tf.sample(rng, thinking=thinking)
        ids, labels = trace(TOK, p)
        call, _, answer = tool_turns(p)
        assert call.startswith("<think>") == thinking
        prompt = prompt_ids(TOK, p)
        assert TOK.decode(prompt).endswith("<|assistant|>\n" + ("" if thinking else "<think></think>"))
        turns = [TOK.encode(call), TOK.encode(answer) + TOK.eos_token_ids()[:1]]
        out, contexts = play_turns(p, prompt, turns, TOK)
        assert out.correct and (out.calls, out.unknown, out.malformed) == (1, 0, 0), (p, call)
        assert ids == contexts[1] + turns[1]
        trained = [t for t, y in zip(ids, labels, strict=True) if y != -100]
        assert trained == turns[0] + turns[1]
        d_ids, d_labels = drill(TOK, p)
        assert [t for t, y in zip(d_ids, d_labels, strict=True) if y != -100] == turns[1]


def test_calls_fill_the_parameters_in_the_schemas_order_and_run_under_any_names() -> None:
    rng = random.Random(3)
    names = set()
    for _ in range(200):
        p = tf.sample(rng)
        a, op, b = operands(p)
        fn = next(t["function"] for t in p.tools if tf.OPERATION_OF.get(t["function"]["name"]) == op)
        first, second = fn["parameters"]["properties"]
        names.add((first, second))
        call = tool_turns(p)[0]
        body = (f"{fn['name']}<arg_key>{first}</arg_key><arg_value>{a}</arg_value><arg_key>{second}</arg_key>"
                f"<arg_value>{b}</arg_value>")  # fmt: skip
        assert call.endswith(f"<tool_call>{body}</tool_call><|observation|>")
        result = ToolRegistry.from_openai(list(p.tools)).resolve(body)
        assert isinstance(result, ToolCall) and ToolUse().run_call(result) == p.answer
    assert len(names) > 10


def test_finetune_trains_with_and_ships_the_tool_rendering_it_was_given(tiny_model: Path, tmp_path: Path) -> None:
    from glm5.errors import ConfigError
    from glm5.tokenizer.build import chat_template
    from glm5_trainer.tool_sft import finetune

    with pytest.raises(ConfigError, match="tool_rendering"):
        finetune(tiny_model, tmp_path / "bad", 1, tool_rendering="yaml")
    record = finetune(tiny_model, tmp_path / "out", 2, tool_batch=2, addition_batch=2, tool_share=1.0,
                      variant_share=1.0, tool_rendering="signatures")  # fmt: skip
    assert record["tool_rendering"] == "signatures"
    tok = Tokenizer(tmp_path / "out")
    assert tok.chat_template == chat_template("signatures") != Tokenizer(tiny_model).chat_template
    p = tf.sample(random.Random(0))
    names = [t["function"]["name"] for t in p.tools]
    assert "<tools>\n" + "".join(f"{n}(" for n in names[:1]) in tok.decode(prompt_ids(tok, p))


def test_made_up_parameter_names_are_new_and_leave_the_held_out_sets_as_they_were() -> None:
    held = {name for pair in tf.HELD_OUT_PARAMS for name in pair}
    seen = set()
    for i in range(500):
        pair = tf.random_params(random.Random(i))
        assert pair[0] != pair[1] and not held & set(pair) and all(n.isidentifier() for n in pair)
        seen.add(pair)
    assert len(seen - set(tf.PARAMS)) > 450  # a short made-up pair can be a known one by chance
    rng = random.Random(7)
    known, new = set(tf.PARAMS) | {q[::-1] for q in tf.PARAMS}, 0
    for _ in range(100):
        p = tf.sample(rng, made_up_params=1.0)
        op = operands(p)[1]
        fn = next(t["function"] for t in p.tools if tf.OPERATION_OF.get(t["function"]["name"]) == op)
        new += tuple(fn["parameters"]["properties"]) not in known
        assert p.id.startswith("train:") and tool_turns(p)[0].count("<arg_key>") == 2
    assert new >= 95
    # a held-out problem never gets made-up names, and a share of 0 draws nothing: the same problems as before
    assert all(tf.sample(random.Random(i), frozenset({"params"}), made_up_params=1.0).id.startswith("params:")
               for i in range(20))  # fmt: skip
    assert [tf.sample(random.Random(i), made_up_params=0.0) for i in range(20)] == [
        tf.sample(random.Random(i)) for i in range(20)]  # fmt: skip
