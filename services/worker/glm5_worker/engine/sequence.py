"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch
from glm5.tokenizer import IncrementalDetokenizer
from llguidance import LLMatcher

from glm5_worker.engine.structured import OutputFormat, Phase


class FinishReason(enum.IntEnum):
    # values match glm5.v1.FinishReason
    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3


@dataclass(slots=True)
class SamplingParams:
    """Validated sampling settings (glm5_worker.engine.validation builds them from requests)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    output_format: OutputFormat | None = None
    seed: int | None = None
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    skip_special_tokens: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True, eq=False)  # identity: the scheduler's membership tests must not compare every field
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    finish_reason: FinishReason = FinishReason.NONE
    stop_reason: str = ""
    generator: torch.Generator | None = None
    # structured output: the format's matcher and where the output is relative to a thinking block
    matcher: LLMatcher | None = None
    format_phase: Phase = "start"
    format_error: str = ""
    # speculative decoding: tokens proposed to follow the last one, verified in the next step, and the proposer's
    # distribution of each (None: one-hot on the token)
    draft_ids: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    mtp_gap: bool = False  # a step ran without the MTP pass over this sequence: its MTP KV rows miss positions
    # filled each step and drained by the engine into a RequestOutput
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_text: str = ""
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE
