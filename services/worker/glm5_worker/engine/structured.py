"""Structured output: JSON Schema, any JSON object, a regular expression or a Lark grammar, enforced by masking
the logits of every token the format does not allow at that point (llguidance computes the masks from the
tokenizer's vocabulary). The masked logits are only those sampled from; logprobs stay the model's own."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance
import llguidance.numpy
import numpy as np
import torch
from glm5.errors import InvalidRequestError
from glm5.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:  # a TypedDict of the stub only
    from llguidance._lib import JsonCompileOptions

FormatKind = Literal["json_schema", "json_object", "regex", "lark_grammar"]
FIELD = "sampling.structured_output"
# compact JSON (json.dumps' separators): with free whitespace, a small or unsure model can spend its tokens on it
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True, slots=True)
class OutputFormat:
    kind: FormatKind
    spec: str = ""  # the schema (JSON text), regex or grammar; unused for json_object
    # a leading thinking block stays free: opened by think_open (or already open: starts_thinking), closed
    # by think_close; the format applies after it
    think_open: int | None = None
    think_close: int | None = None
    starts_thinking: bool = False

    @property
    def first_phase(self) -> Phase:
        return "thinking" if self.starts_thinking else "start"


# start: the format or think_open may come next; thinking: free until think_close; format: the format only
Phase = Literal["start", "thinking", "format"]


class Grammars:
    """Compiles formats against one tokenizer; a matcher per constrained sequence."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._source = tokenizer
        self._eos = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:  # built on first use: most deployments never constrain an output
            json_text = self._source.files[0].decode()
            self._tokenizer = llguidance.LLTokenizer(json_text, n_vocab=self.vocab_size, eos_token=self._eos)
        return self._tokenizer

    def matcher(self, fmt: OutputFormat) -> llguidance.LLMatcher:
        """A fresh matcher for `fmt`; a format that does not compile is the request's error."""
        for name in ("think_open", "think_close"):
            token = getattr(fmt, name)
            if token is not None and not 0 <= token < self.vocab_size:
                raise InvalidRequestError(FIELD, f"{name}_token_id {token} is outside the vocabulary")
        if (fmt.think_open is not None or fmt.starts_thinking) and fmt.think_close is None:
            raise InvalidRequestError(FIELD, "a thinking block needs think_close_token_id")
        try:
            if fmt.kind == "json_schema":
                json.loads(fmt.spec)  # llguidance's own message for bad JSON points into its wrapper
                grammar = llguidance.LLMatcher.grammar_from_json_schema(fmt.spec, defaults=JSON_OPTIONS)
            elif fmt.kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            elif fmt.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(fmt.spec)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(fmt.spec)
        except ValueError as exc:  # json.JSONDecodeError included
            raise InvalidRequestError(FIELD, f"{fmt.kind}: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequestError(FIELD, f"{fmt.kind}: {error.strip()}")
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)


_executor: llguidance.LLExecutor | None = None


def allowed_tokens(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """(n, V) bool: the tokens each format allows next (EOS once it is complete), computed on llguidance's
    threads for the whole batch at once."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), vocab_size)
    llguidance.numpy.fill_next_token_bitmask_par(_executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
    # int32 words, bit j of word w is token 32 w + j (little-endian bytes, least significant bit first)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.astype(bool))
