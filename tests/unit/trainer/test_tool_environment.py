"""The multi-turn tool environment: calls judged by the router's registry and validator, results spliced into the
context as the chat template writes tool messages, rewards and penalties, the built-in calculator problems and
datasets with tools. The model's turns are given as text here (what a model would write); the same environment
runs against real workers and the TITO gateway in tests/integration/tito/test_tool_rollouts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from glm5.errors import ConfigError
from glm5.model.presets import SHIPPED_MODEL
from glm5.tokenizer.tokenizer import Tokenizer
from glm5_trainer.environment import (
    CALCULATOR_TOOLS,
    Outcome,
    Problem,
    ToolUse,
    environment,
    evaluation_summary,
    load_problems,
    tool_problems,
)

from tests.unit.trainer.scripted import play_turns

TOK = Tokenizer(SHIPPED_MODEL)
PROBLEM = Problem("23*7", ({"role": "user", "content": "What is 23 * 7?"},), "161", CALCULATOR_TOOLS)


def call(name: str, **args: object) -> str:
    return (
        f"<tool_call>{name}"
        + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
        + "</tool_call>"
    )


def play(turns: list[str], env: ToolUse | None = None) -> tuple[Outcome, list[list[int]]]:
    """Plays PROBLEM with the model's turns given as text; returns the outcome and the context of every turn."""
    env = env or ToolUse()
    prompt = TOK.encode(
        TOK.apply_chat_template(list(PROBLEM.messages), tools=list(PROBLEM.tools), enable_thinking=True)
    )
    return play_turns(PROBLEM, prompt, [TOK.encode(t) for t in turns], TOK, env)


def test_a_valid_call_then_the_right_answer() -> None:
    first = "<think>23 * 7 needs multiply</think>" + call("multiply", a=23, b=7) + "<|observation|>"
    out, contexts = play([first, "<think>multiply gave 161</think>The answer is 161.<|endoftext|>"])
    assert (out.correct, out.turns, out.calls, out.unknown, out.malformed) == (True, 2, 1, 0, 0)
    assert out.reward == pytest.approx(1.1)  # the answer, and the call bonus
    # the second turn's context extends the first exactly: prompt, the model's tokens, then the tool message as
    # the chat template writes it after the model's own <|observation|>
    prompt = contexts[0]
    assert contexts[1] == prompt + TOK.encode(first) + TOK.encode("\n<tool_response>161</tool_response><|assistant|>\n")
    rendered = TOK.apply_chat_template(
        [*PROBLEM.messages, {"role": "assistant", "content": "", "reasoning_content": "23 * 7 needs multiply",
                             "tool_calls": [{"function": {"name": "multiply", "arguments": {"a": 23, "b": 7}}}]},
         {"role": "tool", "content": "161"}], tools=list(PROBLEM.tools), enable_thinking=True)  # fmt: skip
    assert TOK.decode(contexts[1]) == rendered


def test_a_turn_that_stops_after_its_call_gets_the_observation_token_from_the_environment() -> None:
    out, contexts = play([call("multiply", a=23, b=7), "The answer is 161."])
    assert out.correct and out.calls == 1
    tail = TOK.decode(contexts[1][len(contexts[0]) :])
    assert tail == call("multiply", a=23, b=7) + "<|observation|>\n<tool_response>161</tool_response><|assistant|>\n"


def test_unknown_and_malformed_calls_are_penalised_and_answered_with_the_error() -> None:
    out, contexts = play([call("divide", a=161, b=7) + call("multiply", a="x", b=7) + "<|observation|>",
                          "The answer is 161."])  # fmt: skip
    assert (out.calls, out.unknown, out.malformed, out.correct) == (0, 1, 1, True)
    assert out.reward == pytest.approx(1.0 - 0.5 - 0.25)  # no call bonus: not every call was valid
    tail = TOK.decode(contexts[1][len(contexts[0]) :])
    assert "<tool_response>error: unknown tool 'divide'</tool_response><|observation|>" in tail
    assert "<tool_response>error: a: 'x' is not of type 'integer'</tool_response><|assistant|>" in tail


def test_an_unclosed_call_ends_the_episode_as_malformed() -> None:
    out, contexts = play(["<tool_call>multiply<arg_key>a</arg_key><arg_value>23<|endoftext|>"])
    assert (out.turns, out.malformed, out.correct, len(contexts)) == (1, 1, False, 1)
    assert out.reward == pytest.approx(-0.25)


def test_a_call_without_a_hand_over_is_the_final_turn_and_turns_are_bounded() -> None:
    out, _ = play([call("add", a=1, b=2) + "The answer is 161.<|endoftext|>"])  # answered in the same turn
    assert (out.turns, out.calls, out.correct) == (1, 1, True)
    env = ToolUse(max_turns=3)
    out, contexts = play([call("add", a=1, b=2) + "<|observation|>"] * 3, env)
    assert (out.turns, out.truncated, out.correct, len(contexts)) == (3, True, False, 3)
    assert out.reward == pytest.approx(0.1)  # valid calls, no answer


def test_evaluation_summary() -> None:
    outcomes = [Outcome(1.1, True, calls=1, turns=2), Outcome(-0.5, False, unknown=1, turns=2),
                Outcome(0.0, False, truncated=True, turns=1)]  # fmt: skip
    s = evaluation_summary(outcomes)
    assert s["accuracy"] == pytest.approx(1 / 3) and s["tool_calls"] == 2 and s["tool_call_validity"] == 0.5
    assert (s["unknown_tool_calls"], s["malformed_tool_calls"], s["truncated"]) == (1, 0, 1)
    assert evaluation_summary([Outcome()])["tool_call_validity"] is None


def test_builtin_calculator_problems_and_datasets_with_tools(tmp_path: Path) -> None:
    env = environment("tools")
    assert isinstance(env, ToolUse)
    train, held_out = load_problems("builtin", env)
    assert len(held_out) == 500 and not {p.id for p in train} & {p.id for p in held_out}
    assert all(p.tools == CALCULATOR_TOOLS for p in train + held_out)
    for p in held_out:
        a, op, b = p.messages[0]["content"].removeprefix("What is ").removesuffix("?").split()
        assert p.answer == str(int(a) * int(b) if op == "*" else int(a) + int(b))
    ops = [p.messages[0]["content"].split()[3] for p in held_out]
    assert 150 < ops.count("*") < 350  # both tools are needed
    assert tool_problems(seed=1)[1] != held_out  # the seed picks the split

    f = tmp_path / "tools.jsonl"
    f.write_text(json.dumps({"prompt": "What is 2 * 3?", "answer": 6, "tools": list(CALCULATOR_TOOLS)}) + "\n")
    (p,) = load_problems(str(f), env)[0]
    assert p.tools == CALCULATOR_TOOLS
    bad = [({"tools": {"name": "add"}}, "'tools' must be a list"),
           ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, r"tools\[0\].function.name"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "not a valid JSON schema")]  # fmt: skip
    for extra, message in bad:
        f.write_text(json.dumps({"prompt": "x", "answer": 1, **extra}) + "\n")
        with pytest.raises(ConfigError, match=f"tools.jsonl:1: .*{message}"):
            load_problems(str(f), env)


def test_supervised_traces_are_the_episodes_the_environment_plays() -> None:
    """The SFT traces (glm5_trainer.tool_sft) hold the very tokens an episode's contexts hold: trained as played."""
    from glm5_trainer.tool_sft import tool_turns, trace

    for p in tool_problems()[1][:20]:
        ids, labels = trace(TOK, p)
        call, _, answer = tool_turns(p)
        prompt = TOK.encode(TOK.apply_chat_template(list(p.messages), tools=list(p.tools), enable_thinking=True))
        turns = [TOK.encode(call), TOK.encode(answer) + TOK.eos_token_ids()[:1]]
        out, contexts = play_turns(p, prompt, turns, TOK)
        assert out.correct and out.calls == 1 and out.reward == pytest.approx(1.1)
        assert ids == contexts[1] + turns[1]  # the trace is the second turn's context plus the answer
        trained = [t for t, y in zip(ids, labels, strict=True) if y != -100]
        assert trained == turns[0] + turns[1]  # the loss covers the model's turns, not the prompt or the tool's


def test_answer_drills_train_the_copy_only_and_keep_the_number_split_of_the_tool_message() -> None:
    """A drill is the episode's answer turn after the question asked without tools, the loss on the answer only;
    the answer's number is tokenised as in the tool message (the copy needs no re-split of its digits)."""
    from glm5_trainer.tool_sft import drill, tool_turns

    for p in tool_problems()[1][:20]:
        ids, labels = drill(TOK, p)
        _, result, answer = tool_turns(p)
        trained = [t for t, y in zip(ids, labels, strict=True) if y != -100]
        assert trained == TOK.encode(answer) + TOK.eos_token_ids()[:1] and ids[-len(trained) :] == trained
        context = TOK.decode(ids[: len(ids) - len(trained)], skip_special_tokens=False)
        assert "multiply" not in context.split(p.messages[-1]["content"])[0]  # no tools offered before the question
        number = TOK.encode(p.answer)
        assert TOK.encode(result)[2 : 2 + len(number)] == number  # "\n", "<tool_response>", the result
        start = TOK.encode(answer).index(number[0], 4)
        assert TOK.encode(answer)[start : start + len(number)] == number
        assert ToolUse().reward(p, answer) == 1.0  # the bold answer is judged right


def test_stray_call_markup_is_a_malformed_call_not_an_unknown_tool() -> None:
    # the argument markup without its <tool_call>: what the model wrote on tools it had not seen (issue 34, 7)
    out, _ = play(["The answer is * 51151</arg_value><arg_key>b</arg_key><arg_value>3</arg_value><|endoftext|>"])
    assert (out.calls, out.unknown, out.malformed) == (0, 0, 1)
