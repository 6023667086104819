"""Calculator problems over a family of tool definitions (issue 34, defect 7): the demo model learnt its tools from
one fixed pair (`add` / `multiply`, parameters `a`, `b`, `"additionalProperties": false`) and failed on anything
else, such as the same tools without `additionalProperties` (as most people and OpenAI's examples write them).

A problem here samples how its tools are written, along these axes:

- parameter names (`a`/`b`, `x`/`y`, `first`/`second`, ... in either order; the call fills them in the order
  the schema lists them, the order the `tool_choice` grammar uses), `integer` or `number`, with or without
  property descriptions;
- the schema's form: `additionalProperties` false, absent or true; `required` all, absent or reversed; the
  function's keys in other orders;
- the tool names (`add`, `sum`, `add_numbers`; `multiply`, `product`, `mul`, `multiply_numbers`) and their
  descriptions (or none);
- which tools are offered: both calculator tools or only the one the question needs, plus 0-3 unrelated tools
  (`get_weather`, `subtract`, `divide`, ...), in any order;
- the question's phrasing (`What is 12 + 30?`, `Add 12 and 30.`, `12*30?`, ...), operands of 1-4 digits.

Held out: every axis keeps some values that training never sees (`HELD_OUT_AXES`: parameter names, tool and
property descriptions, unrelated tools, schema styles (pydantic's, with titles; OpenAI's `strict`), phrasings),
and a tenth of the operand pairs (`held_out_pair`, by a hash, whichever order the operands come in). A held-out
problem has at least one held-out axis and a held-out pair; a training problem has neither, nor any pair of
environment.tool_problems' held-out split (the training format's own evaluation).

A problem's id ends in its calculation (`...:4821*3907`, as the training format's ids are `23*7`), which is what
the supervised traces (tool_sft) are written from.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import zlib
from typing import Any

from glm5_trainer.environment import CALCULATOR_TOOLS, Problem

Tool = dict[str, Any]
ADD_NAMES = ("add", "add", "add", "add", "sum", "add_numbers")  # repeated: the weight of each name
MULTIPLY_NAMES = ("multiply", "multiply", "multiply", "multiply", "product", "mul", "multiply_numbers")
OPERATION_OF = {name: "+" for name in ADD_NAMES} | {name: "*" for name in MULTIPLY_NAMES}
CALCULATION = re.compile(r"(\d+)([+*])(\d+)")

PARAMS = (("a", "b"),) * 6 + (("x", "y"), ("x", "y"), ("first", "second"), ("num1", "num2"), ("m", "n"),
          ("left", "right"), ("number1", "number2"), ("p", "q"), ("u", "v"), ("i", "j"), ("value_a", "value_b"),
          ("operand1", "operand2"), ("n1", "n2"), ("int1", "int2"), ("arg1", "arg2"))  # fmt: skip
HELD_OUT_PARAMS = (("lhs", "rhs"), ("x1", "x2"), ("val1", "val2"), ("s", "t"), ("number_a", "number_b"))
_HELD_OUT_NAMES = frozenset(name for pair in HELD_OUT_PARAMS for name in pair)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"

DESCRIPTIONS: dict[str, tuple[str | None, ...]] = {
    "+": ("Add two integers.", "Add two integers.", "Add two numbers.", "Returns the sum of two integers.",
          "Compute the sum of two numbers.", "Addition.", "Add two integers and return the result.", None),
    "*": ("Multiply two integers.", "Multiply two integers.", "Multiply two numbers.",
          "Returns the product of two integers.", "Compute the product of two numbers.", "Multiplication.",
          "Multiply two integers and return the result.", None),
}  # fmt: skip
HELD_OUT_DESCRIPTIONS: dict[str, tuple[str | None, ...]] = {
    "+": ("Calculates the total of two whole numbers.", "Sum two values together and give back the result."),
    "*": ("Calculates two whole numbers multiplied together.", "Multiply one value by another one."),
}
PROPERTY_DESCRIPTIONS = (("The first number.", "The second number."), ("First operand", "Second operand"),
                         ("An integer.", "Another integer."))  # fmt: skip
HELD_OUT_PROPERTY_DESCRIPTIONS = (("Left-hand side value", "Right-hand side value"),)

PHRASINGS = {
    "+": ("What is {a} + {b}?",) * 6 + ("What's {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.",
          "Calculate {a}+{b}", "{a} + {b} = ?", "Add {a} and {b}.", "What is the sum of {a} and {b}?",
          "Please add {a} to {b}.", "How much is {a} + {b}?", "{a}+{b}?"),
    "*": ("What is {a} * {b}?",) * 6 + ("What's {a} * {b}?", "What is {a} times {b}?", "Compute {a} * {b}.",
          "Calculate {a}*{b}", "{a} * {b} = ?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?",
          "What is {a} multiplied by {b}?", "How much is {a} * {b}?", "{a}*{b}?"),
}  # fmt: skip
HELD_OUT_PHRASINGS = {
    "+": ("Can you tell me what {a} + {b} is?", "Find the sum of {a} and {b}.", "I need {a} plus {b}."),
    "*": ("Can you tell me what {a} * {b} is?", "Find the product of {a} and {b}.", "I need {a} times {b}."),
}

_STRING, _INTEGER, _NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
# unrelated tools: (name, description, properties, required); "{p}" properties take the problem's parameters
EXTRAS: tuple[tuple[str, str, dict[str, Any], tuple[str, ...]], ...] = (
    ("get_weather", "Get the current weather for a city.",
     {"city": {"type": "string", "description": "City name"}, "unit": {"type": "string", "enum": ["celsius",
      "fahrenheit"]}}, ("city",)),
    ("subtract", "Subtract two integers.", {"{p}": _INTEGER}, ()),
    ("divide", "Divide one number by another.", {"{p}": _NUMBER}, ()),
    ("get_time", "Get the current time in a time zone.", {"timezone": _STRING}, ("timezone",)),
    ("search_web", "Search the web for a query.", {"query": _STRING}, ("query",)),
    ("send_email", "Send an email.", {"to": _STRING, "subject": _STRING, "body": _STRING}, ("to", "subject", "body")),
    ("convert_currency", "Convert an amount between currencies.",
     {"amount": _NUMBER, "from_currency": _STRING, "to_currency": _STRING}, ("amount", "from_currency", "to_currency")),
    ("lookup_word", "Look up a word in the dictionary.", {"word": _STRING}, ("word",)),
)  # fmt: skip
HELD_OUT_EXTRAS: tuple[tuple[str, str, dict[str, Any], tuple[str, ...]], ...] = (
    ("get_stock_price", "Get the latest price of a stock.", {"symbol": _STRING}, ("symbol",)),
    ("power", "Raise a number to a power.", {"base": _INTEGER, "exponent": _INTEGER}, ("base", "exponent")),
    ("translate", "Translate text into another language.", {"text": _STRING, "target_language": _STRING},
     ("text", "target_language")),
)  # fmt: skip
HELD_OUT_AXES = ("params", "descriptions", "extras", "schema", "phrasing")
# the tools' JSON is about a token a character: this bound keeps an episode under ~1,000 tokens (the model's
# index_topk, so attention stays dense, and the evaluation's context)
MAX_TOOLS_CHARS = 720
BUCKETS = {"1-2 digits": (1, 2), "3 digits": (3,), "4 digits": (4,)}  # by the larger operand's digits


def held_out_pair(op: str, a: int, b: int) -> bool:
    """A tenth of the operand pairs, the same for a op b and b op a: never trained on."""
    return zlib.crc32(f"{min(a, b)}{op}{max(a, b)}".encode()) % 10 == 0


def operand(rng: random.Random, digits: int) -> int:
    return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def calculation(p: Problem) -> tuple[int, str, int]:
    """(a, op, b) of a calculator problem, from its id (`...:a op b`, or the training format's `a op b`)."""
    m = CALCULATION.fullmatch(p.id.rpartition(":")[2])
    if m is None:
        raise ValueError(f"problem {p.id!r} is not a calculator problem")
    return int(m[1]), m[2], int(m[3])


def random_params(rng: random.Random) -> tuple[str, str]:
    """Two made-up parameter names (`qe`/`vwd`, `kop1`/`kop2`, `zu_a`/`zu_b`), none of HELD_OUT_PARAMS': with a
    few dozen names a small model learns them by heart and writes them whatever the schema says; names it
    cannot have seen make copying them from the offered tools the only way to fit."""

    def word() -> str:
        return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 6)))

    while True:
        kind = rng.randrange(3)
        if kind == 0:
            pair = (word(), word())
        else:
            stem, ends = word(), (("1", "2"), ("_1", "_2"), ("_a", "_b"), ("a", "b"))[rng.randrange(4)]
            pair = (stem + ends[0], stem + ends[1])
        if pair[0] != pair[1] and not _HELD_OUT_NAMES.intersection(pair):
            return pair


def _schema(
    params: tuple[str, str],
    prop: dict[str, Any],
    descriptions: tuple[str, str] | None,
    style: str,
    required: str | None,
    extra: bool | None,
) -> dict[str, Any]:
    props = {}
    for i, name in enumerate(params):
        props[name] = dict(prop) | ({"description": descriptions[i]} if descriptions else {})
        if style == "pydantic":  # what pydantic's model_json_schema() writes
            props[name] = {"title": name.replace("_", " ").title(), **props[name]}
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required == "all":
        schema["required"] = list(params)
    elif required == "reversed":
        schema["required"] = list(params)[::-1]
    if extra is not None:
        schema["additionalProperties"] = extra
    if style == "pydantic":
        schema = {"properties": props, "required": list(params), "title": "Arguments", "type": "object"}
    return schema


def _function(rng: random.Random, name: str, description: str | None, parameters: dict[str, Any], style: str) -> Tool:
    fn: dict[str, Any] = {"name": name}
    parts = [("description", description), ("parameters", parameters)]
    if rng.random() < 0.25:
        parts.reverse()
    for key, value in parts:
        if value is not None:
            fn[key] = value
    if style == "strict":  # OpenAI's structured-outputs form
        fn = {"name": name, **({"description": description} if description else {}), "strict": True,
              "parameters": parameters}  # fmt: skip
    return {"type": "function", "function": fn}


def sample(rng: random.Random, held: frozenset[str] = frozenset(), op: str | None = None, digits: tuple[int, int]
           | None = None, thinking: bool = True, exclude: frozenset[str] = frozenset(),
           made_up_params: float = 0.0) -> Problem:  # fmt: skip
    """One problem: `held` names the held-out axes it uses (empty: a training problem); `op` ("+" or "*") and
    `digits` (each operand's) are drawn when not given; the operand pair is a held-out one exactly when `held`
    is not empty, and none in `exclude` (ids `a op b`); `made_up_params`: the chance that the parameters get
    `random_params` names instead of PARAMS' (training only; 0 draws nothing more, so the held-out sets stay
    what they were)."""
    op = op or rng.choice("+*")
    while True:
        da, db = digits or (rng.randint(1, 4), rng.randint(1, 4))
        a, b = operand(rng, da), operand(rng, db)
        if held_out_pair(op, a, b) == bool(held) and f"{a}{op}{b}" not in exclude:
            break
    pick: Any = rng.choice
    params = pick(HELD_OUT_PARAMS if "params" in held else PARAMS)
    if made_up_params and not held and rng.random() < made_up_params:
        params = random_params(rng)
    if rng.random() < 0.2:
        params = params[::-1]
    prop = _INTEGER if rng.random() < 0.8 else _NUMBER
    if "descriptions" in held:
        prop_descriptions = pick((*HELD_OUT_PROPERTY_DESCRIPTIONS, None))
        described = HELD_OUT_DESCRIPTIONS
    else:
        prop_descriptions = pick(PROPERTY_DESCRIPTIONS) if rng.random() < 0.3 else None
        described = DESCRIPTIONS
    style = pick(("pydantic", "strict")) if "schema" in held else "plain"
    required = pick(("all", "all", "all", None, None, "reversed"))
    extra = False if style == "strict" else pick((False, False, None, None, None, True))
    names = {"+": pick(ADD_NAMES), "*": pick(MULTIPLY_NAMES)}
    offered = ["+", "*"] if rng.random() < 0.7 else [op]
    tools = []
    for o in offered:
        own = params if o == op or rng.random() < 0.8 else pick(PARAMS)
        schema = _schema(own, prop, prop_descriptions, style, required, extra)
        tools.append(_function(rng, names[o], pick(described[o]), schema, style))
    chosen = rng.sample(EXTRAS, pick((0, 0, 0, 1, 1, 1, 2, 2)))
    if "extras" in held:
        chosen = [pick(HELD_OUT_EXTRAS), *chosen[:1]]
    for i, (name, description, props, req) in enumerate(chosen):
        if "{p}" in props:
            props, req = dict.fromkeys(params, props["{p}"]), params
        schema = {"type": "object", "properties": props, "required": list(req)}
        if extra is not None:
            schema["additionalProperties"] = extra
        unrelated = _function(rng, name, description, schema, style)
        if i == 0 or len(json.dumps([*tools, unrelated])) <= MAX_TOOLS_CHARS:
            tools.append(unrelated)
    rng.shuffle(tools)
    question = pick(HELD_OUT_PHRASINGS[op] if "phrasing" in held else PHRASINGS[op]).format(a=a, b=b)
    tag = "+".join(sorted(held)) or "train"
    return Problem(f"{tag}:{a}{op}{b}", ({"role": "user", "content": question},), str(a + b if op == "+" else a * b),
                   tuple(tools), thinking=thinking)  # fmt: skip


def held_out_axes(rng: random.Random) -> frozenset[str]:
    """A non-empty random set of held-out axes, each with probability 0.4."""
    while True:
        held = frozenset(axis for axis in HELD_OUT_AXES if rng.random() < 0.4)
        if held:
            return held


def held_out_problems(per_bucket: int = 200, seed: int = 0, thinking: bool = True) -> dict[str, list[Problem]]:
    """The held-out evaluation: `per_bucket` problems per operand bucket (`BUCKETS`: the larger operand has that
    many digits, the other 1 to as many), every one with held-out axes and a held-out operand pair."""
    rng = random.Random(f"held-out {seed}")
    out: dict[str, list[Problem]] = {}
    for bucket, sizes in BUCKETS.items():
        seen: set[str] = set()
        out[bucket] = []
        while len(out[bucket]) < per_bucket:
            top = rng.choice(sizes)
            other = rng.randint(1, top)
            digits = (top, other) if rng.random() < 0.5 else (other, top)
            p = sample(rng, held_out_axes(rng), digits=digits, thinking=thinking)
            if p.id not in seen:
                seen.add(p.id)
                out[bucket].append(p)
    return out


def readme_problems(n: int = 200, seed: int = 0) -> list[Problem]:
    """README's two tools without `"additionalProperties": false` (issue 34's report), held-out operand pairs of
    1-4 digits, `What is a op b?`."""
    tools = tuple({"type": "function", "function": {**t["function"], "parameters": {
        k: v for k, v in t["function"]["parameters"].items() if k != "additionalProperties"}}}
        for t in CALCULATOR_TOOLS)  # fmt: skip
    rng = random.Random(f"readme {seed}")
    out: dict[str, Problem] = {}
    while len(out) < n:
        op, a, b = rng.choice("+*"), operand(rng, rng.randint(1, 4)), operand(rng, rng.randint(1, 4))
        if held_out_pair(op, a, b):
            question = {"role": "user", "content": f"What is {a} {op} {b}?"}
            out[f"{a}{op}{b}"] = Problem(f"readme:{a}{op}{b}", (question,), str(a + b if op == "+" else a * b), tools)
    return list(out.values())


def evaluation_sets(per_bucket: int = 200, seed: int = 0) -> dict[str, list[Problem]]:
    """What benchmarks/agentic_eval.py --variants measures beside the training format: the held-out variants per
    operand bucket, the same problems' first third of each bucket with thinking off, and README's tools without
    `additionalProperties`."""
    held = held_out_problems(per_bucket, seed)
    sets = {f"held-out variants, {bucket}": problems for bucket, problems in held.items()}
    off = [dataclasses.replace(p, thinking=False) for problems in held.values() for p in problems[: per_bucket // 3]]
    sets["held-out variants, thinking off"] = off
    sets["README tools without additionalProperties"] = readme_problems(per_bucket, seed)
    return sets
