"""OpenAI's response shapes from the workers' answers: finish reasons, usage, tool calls, logprobs, and the raw
text of a completions choice."""

from __future__ import annotations

import json
from typing import Any

from glm5.parsing.reasoning import THINK_CLOSE, THINK_OPEN
from glm5.parsing.tools import ToolCall
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import common_pb2, worker_pb2

from glm5_router.frontend import Delta

FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
          common_pb2.FINISH_REASON_ABORT: "abort"}  # fmt: skip


def usage_json(finals: dict[int, worker_pb2.GenerateResponse], n: int) -> dict[str, Any]:
    """Usage of a request's choices (by index, n per prompt): each prompt once, as OpenAI counts it, and the
    completions summed."""
    firsts = [r.usage for i, r in finals.items() if i % n == 0]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(r.usage.completion_tokens for r in finals.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in firsts)}}  # fmt: skip


class TextChoice:
    """Per-choice state of a completions response: the raw-text reconstruction and logprob offsets."""

    def __init__(self, index: int, in_reasoning: bool, echo: str, prompt_ids: list[int]) -> None:
        self.index, self.thinking, self.offset, self.pending = index, in_reasoning, 0, echo
        self.prompt_ids = prompt_ids

    def text(self, d: Delta) -> str:
        """The generated text as the model wrote it: the parser's reasoning back inside its tags (an echoed
        prompt first)."""
        out, self.pending = self.pending, ""
        if d.reasoning:
            out += "" if self.thinking else THINK_OPEN
            out, self.thinking = out + d.reasoning, True
        if d.content:
            out += THINK_CLOSE if self.thinking else ""
            out, self.thinking = out + d.content, False
        return out


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    out: dict[str, Any] = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
    if index is not None:
        out["index"] = index
    return out


def _token(tok: Tokenizer, token_id: int) -> str:
    # a token that ends inside a UTF-8 character decodes to U+FFFD on its own, as in vLLM's logprobs
    return tok.decode([token_id])


def chat_logprobs(tok: Tokenizer, lps: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat `choice.logprobs`: one entry per generated token, reasoning tokens included."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token(tok, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}
            for lp in lps
        ]
    }


def completion_logprobs(
    tok: Tokenizer, lps: list[common_pb2.TokenLogprob | None], token_ids: list[int], offset: int
) -> dict[str, Any]:
    """OpenAI completions `choice.logprobs`; None entries (the echoed prompt's first token) have no logprob."""
    tokens = [_token(tok, t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob if lp is not None else None for lp in lps],
        "top_logprobs": [
            {_token(tok, t.token_id): t.logprob for t in lp.top} if lp is not None else None for lp in lps
        ],
        "text_offset": offsets,
    }
