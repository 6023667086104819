"""Reward environments: problems with a verifiable answer, played turn by turn, and the reward of an episode.

- `addition` (the demo model's first task): one turn; the answer is right when the text holds "The answer is N"
  with the expected N: reward 1.0, else 0.0.
- `tools` (agentic): the problem comes with OpenAI-style function tools (a calculator: `add` and `multiply`);
  the model calls them in GLM-5's format (`<tool_call>add<arg_key>a</arg_key><arg_value>12</arg_value>...`),
  ending its turn with `<|observation|>`; the environment runs each call and returns the results as tool
  messages, and the model continues until it answers. Calls are judged by the router's own registry and
  validator (glm5.parsing.tools), so training and serving agree on what a valid call is. Reward: 1.0 for the
  right final answer, `call_bonus` once for an episode whose calls were all valid, minus `unknown_penalty` per
  call to a tool outside the registry (the hallucinated-API problem) and `malformed_penalty` per malformed one
  (arguments that do not validate, a call not closed).

Problems come from `--dataset builtin` (each environment's own: the demo model's training split of two-number
additions; calculator problems whose operands are beyond mental arithmetic for the tiny model) or a JSONL file,
one problem per line:

    {"prompt": "What is 12 + 30?", "answer": "42"}
    {"messages": [{"role": "user", "content": "..."}], "answer": "7", "split": "eval"}
    {"prompt": "What is 123 * 45?", "answer": "5535", "tools": [{"type": "function", "function": {...}}]}

Lines with `"split": "eval"` are held out for evaluation; every other line is trained on.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5.errors import ConfigError
from glm5.parsing.tools import CALL_CLOSE, ToolCall, ToolCallError, ToolCallParser, ToolRegistry
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import common_pb2

from glm5_trainer.sft import ANSWER, problem, split_pairs

# One model turn: the whole context so far -> (the tokens generated, whether the turn hit its length limit)
Generate = Callable[[list[int]], Awaitable[tuple[list[int], bool]]]
THINK_CLOSE = "</think>"
OBSERVATION = "<|observation|>"
PROMPT_TOKEN_LIMIT = 1 << 20  # only bounds memory: an engine refuses a prompt longer than its context


@dataclass(frozen=True, slots=True)
class Problem:
    id: str
    messages: tuple[dict[str, str], ...]
    answer: str
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI-style function tools offered with the problem
    thinking: bool = True  # False: asked with thinking off (the chat template's empty <think></think> turns)


@dataclass(slots=True)
class Outcome:
    """How one episode went."""

    reward: float = 0.0
    correct: bool = False
    truncated: bool = False  # a turn hit its length limit, or the turns ran out
    turns: int = 0
    calls: int = 0  # valid calls to registered tools
    unknown: int = 0  # calls to tools not in the registry
    malformed: int = 0  # calls whose arguments did not validate, or that were not closed


def prompt_ids(tok: Tokenizer, p: Problem) -> list[int]:
    """The problem as the model sees it: its messages (and tools, if it offers any) through the chat template."""
    return tok.encode_chat(list(p.messages), PROMPT_TOKEN_LIMIT, tools=list(p.tools) or None,
                           enable_thinking=p.thinking)[0]  # fmt: skip


async def read_turn(stream: AsyncIterator[Any]) -> tuple[list[int], bool]:
    """One turn's tokens from a Worker.Generate or TitoGateway.Turn stream, and whether it hit its length limit."""
    ids: list[int] = []
    finish = common_pb2.FINISH_REASON_UNSPECIFIED
    async for r in stream:
        ids.extend(r.token_ids)
        finish = r.finish_reason or finish
    return ids, finish == common_pb2.FINISH_REASON_LENGTH


class ExactAnswer:
    """Reward 1.0 when the first "The answer is N" in the text names the expected answer. One turn."""

    name = "addition"
    pattern: re.Pattern[str] = ANSWER

    def reward(self, p: Problem, text: str) -> float:
        m = self.pattern.search(text)
        return 1.0 if m is not None and m.group(1) == p.answer else 0.0

    def builtin(self, held_out: int, seed: int) -> tuple[list[Problem], list[Problem]]:
        return builtin_problems(held_out=held_out, seed=seed)

    async def play(self, p: Problem, prompt: list[int], generate: Generate, tok: Tokenizer) -> Outcome:
        ids, truncated = await generate(prompt)
        reward = self.reward(p, tok.decode(ids, skip_special_tokens=True))
        return Outcome(reward, reward == 1.0, truncated, turns=1)


def _integer_tool(name: str, description: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}  # fmt: skip


CALCULATOR_TOOLS: tuple[dict[str, Any], ...] = (
    _integer_tool("add", "Add two integers."),
    _integer_tool("multiply", "Multiply two integers."),
)
# by tool name, the names tool_family's tools take; called with the operands in the order the call gives them
# (the parameter names vary)
CALCULATOR: dict[str, Callable[..., Any]] = {name: (lambda a, b: a + b) for name in ("add", "sum", "add_numbers")}
CALCULATOR |= {name: (lambda a, b: a * b) for name in ("multiply", "product", "mul", "multiply_numbers")}


@dataclass
class ToolUse(ExactAnswer):
    """Multi-turn calculator problems: the model calls the offered tools, the environment answers each call."""

    name = "tools"
    max_turns: int = 4
    call_bonus: float = 0.1
    unknown_penalty: float = 0.5
    malformed_penalty: float = 0.25
    functions: dict[str, Callable[..., Any]] = field(default_factory=lambda: dict(CALCULATOR))

    def builtin(self, held_out: int, seed: int) -> tuple[list[Problem], list[Problem]]:
        return tool_problems(held_out=held_out, seed=seed)

    def run_call(self, call: ToolCall) -> str:
        """The tool message's content for a valid call (a tool the environment cannot run answers an error)."""
        fn = self.functions.get(call.name)
        if fn is None:
            return f"error: the environment has no implementation of {call.name!r}"
        try:
            return str(fn(*call.arguments.values()))
        except (TypeError, ValueError) as exc:  # a dataset's own tool of that name with other parameters
            return f"error: {exc}"

    async def play(self, p: Problem, prompt: list[int], generate: Generate, tok: Tokenizer) -> Outcome:
        registry = ToolRegistry.from_openai(list(p.tools))
        observation, call_close = tok.encode(OBSERVATION), tok.encode(CALL_CLOSE)
        out = Outcome()
        context = list(prompt)
        while True:
            ids, truncated = await generate(context)
            out.turns += 1
            text = tok.decode(ids)
            parser = ToolCallParser(registry)
            content = text.rpartition(THINK_CLOSE)[2] if THINK_CLOSE in text else text
            results: list[ToolCall | ToolCallError] = []
            for piece in (parser.feed(content.removesuffix(OBSERVATION))[1], parser.finish()[1]):
                results += piece
            for r in results:
                if isinstance(r, ToolCall):
                    out.calls += 1
                elif r.reason == "unknown_tool":  # stray markup has no registered name either: malformed
                    out.unknown += 1
                else:
                    out.malformed += 1
            # A turn with calls in it that hands over to the environment gets their results: it ends with GLM's
            # <|observation|>, or right after its last call (a turn constrained to tool calls stops there, as
            # `tool_choice` does); anything else is the final answer.
            observed = ids[-len(observation) :] == observation
            if not results or truncated or not (observed or ids[-len(call_close) :] == call_close):
                out.truncated = truncated
                out.correct = self.reward(p, tok.decode(ids, skip_special_tokens=True)) == 1.0
                break
            if out.turns >= self.max_turns:
                out.truncated = True
                break
            # The results are appended to the recorded tokens as the chat template writes tool messages (the
            # model's own <|observation|>, if it wrote one, opens the first): what was generated is never
            # re-tokenised, so the context extends the gateway's ledger exactly.
            # A result is data (an error message quotes the model's own text): encoded as plain text, so nothing
            # in it becomes a turn or a call, as the router encodes a tool message.
            responses = [self.run_call(r) if isinstance(r, ToolCall) else f"error: {r.error}" for r in results]
            context += ids
            for i, c in enumerate(responses):
                context += tok.encode(("" if i == 0 and observed else OBSERVATION) + "\n<tool_response>")
                context += tok.encode_literal(c) + tok.encode("</tool_response>")
            context += tok.encode("<|assistant|>\n" + ("" if p.thinking else "<think></think>"))
        good = out.calls > 0 and not out.unknown and not out.malformed
        out.reward = (float(out.correct) + (self.call_bonus if good else 0.0) - self.unknown_penalty * out.unknown
                      - self.malformed_penalty * out.malformed)  # fmt: skip
        return out


def evaluation_summary(outcomes: list[Outcome]) -> dict[str, Any]:
    """What an evaluation reports: final-answer accuracy and how the episodes called tools (validity: the share
    of calls that were valid calls to registered tools; None when no call was made)."""
    n = max(1, len(outcomes))
    calls, unknown, malformed = (sum(getattr(o, k) for o in outcomes) for k in ("calls", "unknown", "malformed"))
    total = calls + unknown + malformed
    return {"problems": len(outcomes), "accuracy": sum(o.correct for o in outcomes) / n,
            "truncated": sum(o.truncated for o in outcomes), "tool_calls": total,
            "tool_call_validity": calls / total if total else None, "unknown_tool_calls": unknown,
            "malformed_tool_calls": malformed, "mean_turns": sum(o.turns for o in outcomes) / n}  # fmt: skip


ENVIRONMENTS: dict[str, type[ExactAnswer]] = {"addition": ExactAnswer, "tools": ToolUse}


def environment(name: str) -> ExactAnswer:
    if name not in ENVIRONMENTS:
        raise ConfigError(f"unknown environment {name!r} (known: {sorted(ENVIRONMENTS)})")
    return ENVIRONMENTS[name]()


BUILTIN = "builtin"


def builtin_problems(max_operand: int = 99, held_out: int = 500, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """The demo model's split: (training problems, held-out problems)."""
    train, test = split_pairs(max_operand, held_out, seed)

    def make(a: int, b: int) -> Problem:
        return Problem(f"{a}+{b}", tuple(problem(a, b)[0]), str(a + b))

    return [make(a, b) for a, b in train], [make(a, b) for a, b in test]


def tool_problems(held_out: int = 500, seed: int = 0, per_tool: int = 9604) -> tuple[list[Problem], list[Problem]]:
    """Calculator problems with the `add` and `multiply` tools offered: products of two numbers in 2..99 (beyond
    what the tiny model works out in its head) and sums of two in 0..999, `per_tool` of each; (training,
    held-out)."""
    rng = random.Random(seed)
    products = [(a, b) for a in range(2, 100) for b in range(2, 100)]
    rng.shuffle(products)
    sums = {(rng.randrange(1000), rng.randrange(1000)) for _ in range(per_tool * 2)}
    chosen = [("*", a, b) for a, b in products[:per_tool]] + [("+", a, b) for a, b in sorted(sums)[:per_tool]]
    rng.shuffle(chosen)
    out = [Problem(f"{a}{op}{b}", ({"role": "user", "content": f"What is {a} {op} {b}?"},),
                   str(a * b if op == "*" else a + b), CALCULATOR_TOOLS) for op, a, b in chosen]  # fmt: skip
    return out[held_out:], out[:held_out]


def _parse_line(path: Path, n: int, line: str) -> tuple[Problem, bool]:
    where = f"{path}:{n}"
    try:
        item: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: each line must be a JSON object")
    if "answer" not in item or not isinstance(item["answer"], (str, int)) or isinstance(item["answer"], bool):
        raise ConfigError(f"{where}: 'answer' (a string or an integer) is required")
    if isinstance(item.get("prompt"), str) and "messages" not in item:
        messages: list[Any] = [{"role": "user", "content": item["prompt"]}]
    elif isinstance(item.get("messages"), list) and item["messages"]:
        messages = item["messages"]
    else:
        raise ConfigError(f"{where}: give 'prompt' (a string) or 'messages' (a non-empty list)")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: every message needs string 'role' and 'content'")
    tools = item.get("tools", [])
    if not isinstance(tools, list):
        raise ConfigError(f"{where}: 'tools' must be a list of function tools")
    try:
        ToolRegistry.from_openai(tools)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    split = item.get("split", "train")
    if split not in ("train", "eval"):
        raise ConfigError(f"{where}: 'split' must be 'train' or 'eval', got {split!r}")
    return Problem(str(item.get("id", n)), tuple(messages), str(item["answer"]), tuple(tools)), split == "eval"


def load_problems(dataset: str, env: ExactAnswer | None = None, held_out: int = 500,
                  seed: int = 0) -> tuple[list[Problem], list[Problem]]:  # fmt: skip
    """(training problems, evaluation problems) from `builtin` (the environment's own) or a JSONL file; errors
    name the line."""
    if dataset == BUILTIN:
        return (env or ExactAnswer()).builtin(held_out, seed)
    path = Path(dataset)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read dataset {path}: {exc.strerror}") from exc
    train: list[Problem] = []
    evaluation: list[Problem] = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            p, is_eval = _parse_line(path, n, line)
            (evaluation if is_eval else train).append(p)
    if not train:
        raise ConfigError(f"dataset {path} has no training problems")
    return train, evaluation
