"""Request JSON -> protobuf fields, checked before anything reaches protobuf or a worker: types, integer and float
ranges (400 naming the field, never a 500 from protobuf's own range check), and the size limits that bound what
one request may cost (docs/router.md, "Limits")."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from glm5.v1 import common_pb2, worker_pb2

from glm5_router.frontend import Thinking
from glm5_router.http.errors import ApiError, invalid

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
INT64_MIN = -(2**63)
MAX_LOGPROBS = 20  # the workers' limit (top_logprobs)
MAX_CHOICES = 64  # `n`: each choice is a request of its own on the workers


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may hold; every one a RouterConfig setting."""

    max_stop: int = 16
    max_stop_chars: int = 1000
    max_logit_bias: int = 1024
    max_format_chars: int = 64 << 10  # a regex, grammar or JSON Schema (serialised)


def get(body: dict[str, Any], key: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    allowed = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in allowed:
        raise invalid(key, f"expected {'/'.join(t.__name__ for t in allowed)}, got a boolean")
    if not isinstance(value, allowed):
        raise invalid(key, f"expected {'/'.join(t.__name__ for t in allowed)}, got {type(value).__name__}")
    return value


def integer(body: dict[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int | None:
    """An integer field within [lo, hi]; an integral float (8.0, as some clients send) counts as one."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(key, f"expected an integer, got {type(value).__name__}")
    if isinstance(value, float):
        if not value.is_integer():
            raise invalid(key, f"expected an integer, got {value}")
        value = int(value)
    if not lo <= value <= hi:
        raise invalid(key, f"must be in {lo}..{hi}, got {value}")
    return value


def number(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(key, f"expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or not lo <= value <= hi:
        raise invalid(key, f"must be in [{lo:g}, {hi:g}], got {value}")
    return float(value)


def sampling(body: dict[str, Any], limits: Limits) -> worker_pb2.GenerateRequest:
    req = worker_pb2.GenerateRequest()
    s = req.sampling
    # OpenAI's documented ranges, wide where vLLM is wider (repetition_penalty is vLLM's)
    for key, lo, hi in (("temperature", 0.0, 100.0), ("top_p", 0.0, 1.0), ("repetition_penalty", 1e-6, 100.0),
                        ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):  # fmt: skip
        value = number(body, key, lo, hi)
        if value is not None:
            setattr(s, key, value)
    if s.HasField("top_p") and s.top_p == 0:  # OpenAI treats it as the single most likely token: greedy
        s.temperature, s.top_p = 0.0, 1.0
    top_k = integer(body, "top_k", -1, INT32_MAX)
    if top_k is not None:
        s.top_k = max(top_k, 0)  # vLLM's -1 and our 0 both mean "off"
    seed = integer(body, "seed", INT64_MIN, UINT64_MAX)
    if seed is not None:
        s.seed = seed % 2**64  # a negative seed (vLLM takes int64) maps to the same 64 bits
    max_tokens = integer(body, "max_completion_tokens", 1, INT32_MAX)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", 1, INT32_MAX)
    if max_tokens is not None:
        s.max_new_tokens = max_tokens
    min_tokens = integer(body, "min_tokens", 0, INT32_MAX)
    if min_tokens:
        s.min_tokens = min_tokens
    s.ignore_eos = get(body, "ignore_eos", bool, False)
    # accepted for vLLM's clients; the router always takes the model's control tokens out of the text it returns
    get(body, "skip_special_tokens", bool)
    _stop(body, s, limits)
    _logit_bias(body, s, limits)
    structured_output(body, s, limits)
    return req


def _stop(body: dict[str, Any], s: common_pb2.SamplingParams, limits: Limits) -> None:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        return
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise invalid("stop", "expected a non-empty string or a list of them")
    if len(stop) > limits.max_stop or any(len(x) > limits.max_stop_chars for x in stop):
        raise invalid("stop", f"at most {limits.max_stop} strings of up to {limits.max_stop_chars} characters")
    s.stop.extend(stop)


def _logit_bias(body: dict[str, Any], s: common_pb2.SamplingParams, limits: Limits) -> None:
    bias = get(body, "logit_bias", dict, {})
    if len(bias) > limits.max_logit_bias:
        raise invalid("logit_bias", f"at most {limits.max_logit_bias} tokens, got {len(bias)}")
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid("logit_bias", f"keys are token ids, got {key!r}") from None
        if not 0 <= token <= INT32_MAX:
            raise invalid("logit_bias", f"token id {token} is out of range")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise invalid("logit_bias", f"values are numbers in [-100, 100], got {value!r}")
        s.logit_bias[token] = float(value)


def structured_output(body: dict[str, Any], s: common_pb2.SamplingParams, limits: Limits) -> None:
    """OpenAI's `response_format` (json_object, json_schema) and vLLM's `guided_json`, `guided_regex`,
    `guided_choice`, `guided_grammar` (Lark, llguidance's dialect) -> SamplingParams.structured_output."""
    given = [k for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if body.get(k) is not None]
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise invalid("response_format", "type must be text, json_object or json_schema")
        if fmt["type"] != "text":
            given.append("response_format")
    if len(given) > 1:
        raise ApiError(400, f"give one output format, got {', '.join(given)}", "invalid_request_error", given[1])
    if not given:
        return
    key, value = given[0], body[given[0]]
    so = s.structured_output
    if key == "response_format" and value["type"] == "json_object":
        so.json_object = True
        return
    if key in ("response_format", "guided_json"):
        schema = (value.get("json_schema") or {}).get("schema") if key == "response_format" else value
        where = "response_format.json_schema.schema" if key == "response_format" else key
        if isinstance(schema, dict):
            schema = json.dumps(schema)
        if not isinstance(schema, str):
            raise ApiError(400, f"{where}: a JSON Schema object is required", "invalid_request_error", key)
        so.json_schema = _bounded_format(where, schema, limits)
    elif key == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid(key, "a non-empty list of strings")
        so.regex = _bounded_format(key, "|".join(f"({re.escape(c)})" for c in value), limits)
    elif not isinstance(value, str):
        raise invalid(key, "a string")
    elif key == "guided_regex":
        so.regex = _bounded_format(key, value, limits)
    else:
        so.lark_grammar = _bounded_format(key, value, limits)


def _bounded_format(key: str, text: str, limits: Limits) -> str:
    if len(text) > limits.max_format_chars:
        raise invalid(key, f"at most {limits.max_format_chars} characters, got {len(text)}")
    return text


def thinking(body: dict[str, Any]) -> Thinking | None:
    t = body.get("thinking")
    if isinstance(t, dict) and t.get("type") in ("enabled", "disabled"):
        return "deep" if t["type"] == "enabled" else "off"
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and isinstance(kwargs.get("enable_thinking"), bool):
        return "deep" if kwargs["enable_thinking"] else "off"
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "none"):
            raise invalid("reasoning_effort", "low, medium, high or none")
        return {"none": "off", "low": "light"}.get(effort, "deep")  # type: ignore[return-value]
    if t is not None:
        raise invalid("thinking", "expected {'type': 'enabled' | 'disabled'}")
    return None


def prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's `prompt`: a string, a list of token ids, or a list of either (a batch)."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str) or is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        return list(prompt)
    raise invalid("prompt", "a string, a list of token ids, or a non-empty list of either")


def choices(body: dict[str, Any]) -> int:
    n = integer(body, "n", 1, MAX_CHOICES, 1)
    assert n is not None
    return n


def logprobs_count(body: dict[str, Any], key: str) -> int | None:
    return integer(body, key, 0, MAX_LOGPROBS)
