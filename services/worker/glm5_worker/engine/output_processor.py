"""Rank 0 after each forward step: logits into tokens, tokens into sequences (stop rules, structured output,
detokenisation), sequences into the outputs callers stream (vLLM's output processor / `update_from_output`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from glm5.tokenizer import Tokenizer

from glm5_worker.engine.sampler import Sampler, token_logprob
from glm5_worker.engine.scheduler import ScheduledStep
from glm5_worker.engine.sequence import FinishReason, Sequence, TokenLogprob
from glm5_worker.engine.speculative import SpecCounters, verify

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]
    finish_reason: FinishReason
    stop_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    weight_version: int
    error: str = ""  # the request failed while it ran (its output format broke): the caller gets this error

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, sampler: Sampler, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.generated_tokens_total = 0
        self.spec: SpecCounters | None = None  # speculative decoding's counters, when the engine speculates

    def process(self, sched: ScheduledStep, logits: torch.Tensor, rows: dict[int, list[int]]) -> None:
        """Advances the step's sequences past the tokens it computed and samples the next token of each
        sequence whose prompt is done; `rows` maps id(seq) to its rows in `logits`. A decoding sequence with drafts
        has a row per draft more and may advance by several tokens (glm5_worker.engine.speculative)."""
        to_sample: list[Sequence] = []
        sample_rows: list[int] = []
        for seq in sched.decodes:
            r = rows[id(seq)]
            if len(r) > 1:
                self._verify(seq, logits[r[0] : r[-1] + 1])
                continue
            seq.num_computed_tokens += 1
            to_sample.append(seq)
            sample_rows.append(r[0])
        for seq, n in sched.prefills:
            p0 = seq.num_computed_tokens
            seq.num_computed_tokens += n
            r = rows[id(seq)]
            if seq.params.prompt_logprobs and r:
                self._prompt_logprobs(seq, logits[r[0] : r[-1] + 1], p0)
            if seq.num_computed_tokens == seq.num_tokens:
                to_sample.append(seq)
                sample_rows.append(r[-1])
        if to_sample:
            picks = self.sampler.sample(logits[sample_rows], to_sample)
            for seq, pick in zip(to_sample, picks, strict=True):
                self._append_token(seq, pick)

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Accepts a prefix of the sequence's drafts and appends it with the target's next token; the positions
        of the accepted tokens' predecessors are computed (their KV rows hold), the rest are written over later.
        Under an output format each row is masked as the format stands after the drafts before it."""
        drafts, probs = seq.draft_ids, seq.draft_probs
        seq.draft_ids, seq.draft_probs = [], []
        constrained = self._constrained_rows(seq, logits, drafts) if seq.matcher is not None else None
        picks, accepted = verify(logits, drafts, probs, seq, self.sampler, constrained)
        if self.spec is not None:
            self.spec.record(len(drafts), accepted)
        seq.num_computed_tokens += len(picks)
        for pick in picks:
            self._append_token(seq, pick)
            if seq.is_finished:  # EOS, a stop string or the length limit inside the accepted run ends it there
                break

    def _constrained_rows(self, seq: Sequence, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """The verify rows with the format's mask: row i as the format stands after drafts[:i]. Rows after a draft
        the format refuses are never read (that draft is rejected: its probability is 0) and stay unmasked."""
        rows = [logits.float()[i : i + 1] for i in range(len(drafts) + 1)]
        with drafts_applied(seq) as advance:
            for i in range(len(drafts) + 1):
                rows[i] = self.sampler.constrain(rows[i], [seq])
                if i < len(drafts) and not advance(drafts[i]):
                    break
        return torch.cat(rows)

    def _prompt_logprobs(self, seq: Sequence, chunk_logits: torch.Tensor, p0: int) -> None:
        lp = torch.log_softmax(chunk_logits.float(), dim=-1)
        prompt = seq.prompt_ids
        for i in range(lp.shape[0]):
            target = p0 + i + 1
            if target < len(prompt):
                seq.prompt_logprobs.append(token_logprob(lp[i], prompt[target], seq.params.top_logprobs))

    def _append_token(self, seq: Sequence, pick: TokenLogprob) -> None:
        token = pick.token_id
        params = seq.params
        seq.output_ids.append(token)
        seq.new_token_ids.append(token)
        if params.logprobs:
            seq.new_logprobs.append(pick)
        self.generated_tokens_total += 1
        grammar_done = self._advance_format(seq, token)
        if not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, self.tokenizer.id_to_token(token) or str(token)
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, str(token)
        else:
            seq.pending_text += seq.detokenizer.add(token)
            if seq.detokenizer.stopped_by is not None:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, seq.detokenizer.stopped_by
            elif grammar_done and seq.format_error:
                seq.finish_reason, seq.stop_reason = FinishReason.ABORT, "structured_output_error"
            elif grammar_done:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, "structured_output"
            elif len(seq.output_ids) >= params.max_new_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = FinishReason.LENGTH
        if seq.is_finished:
            seq.pending_text += seq.detokenizer.flush()

    @staticmethod
    def _advance_format(seq: Sequence, token: int) -> bool:
        """Feeds a sampled token to the sequence's format; True once the format is complete."""
        fmt, matcher = seq.params.output_format, seq.matcher
        if matcher is None or fmt is None or in_thinking(seq, token):
            return False
        seq.format_phase = "format"
        if not matcher.consume_token(token):
            # a format that validated but cannot run (a{1000000}: "too many expressions") fails the request rather
            # than ending it as if the format were complete
            error = (matcher.get_error() or "the output format failed").split("\n<state>")[0].strip()
            seq.format_error = f"the output format cannot be applied: {error}"
            log.info("%s: %s", seq.request_id, seq.format_error)
            return True
        return matcher.is_stopped()

    @staticmethod
    def drain(seq: Sequence, weight_version: int) -> RequestOutput | None:
        """What the sequence produced since its last output (None if nothing)."""
        pending_prompt = seq.params.prompt_logprobs and not seq.prompt_logprobs_sent and seq.output_ids
        if not seq.new_token_ids and not seq.is_finished and not pending_prompt:
            return None
        out = RequestOutput(
            request_id=seq.request_id,
            token_ids=seq.new_token_ids,
            text=seq.pending_text,
            logprobs=seq.new_logprobs,
            prompt_logprobs=seq.prompt_logprobs if pending_prompt else [],
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            cached_prompt_tokens=seq.num_cached_prompt_tokens,
            weight_version=weight_version,
            error=seq.format_error if seq.is_finished else "",
        )
        if pending_prompt:
            seq.prompt_logprobs_sent = True
        seq.new_token_ids, seq.new_logprobs, seq.pending_text = [], [], ""
        return out

    @staticmethod
    def aborted(seq: Sequence, stop_reason: str, weight_version: int) -> RequestOutput:
        """The final output of a sequence ended from outside (shutdown)."""
        return RequestOutput(
            seq.request_id, [], "", [], [], FinishReason.ABORT, stop_reason, len(seq.prompt_ids),
            len(seq.output_ids), seq.num_cached_prompt_tokens, weight_version,
        )  # fmt: skip


def in_thinking(seq: Sequence, token: int) -> bool:
    """Moves the output format's phase past `token` where it opens, continues or closes a thinking block (which
    the format leaves free): True then, and the matcher is not to see it."""
    fmt = seq.params.output_format
    assert fmt is not None
    if seq.format_phase == "thinking":
        if token == fmt.think_close:
            seq.format_phase = "format"
        return True
    if seq.format_phase == "start" and token == fmt.think_open:
        seq.format_phase = "thinking"
        return True
    return False


@contextlib.contextmanager
def drafts_applied(seq: Sequence) -> Iterator[Callable[[int], bool]]:
    """Within the block, `advance(token)` moves the sequence's output format past a draft token if the format
    allows it there (as OutputProcessor._advance_format would: a thinking block stays free), else returns False
    and moves nothing; on leaving, the format is back where it was (the matcher rolled back)."""
    fmt, matcher = seq.params.output_format, seq.matcher
    assert fmt is not None and matcher is not None
    phase, consumed = seq.format_phase, 0

    def advance(token: int) -> bool:
        nonlocal consumed
        if in_thinking(seq, token):
            return True
        if matcher.is_stopped() or matcher.validate_tokens([token]) != 1 or not matcher.consume_token(token):
            return False
        seq.format_phase = "format"
        consumed += 1
        return True

    try:
        yield advance
    finally:
        if consumed:
            matcher.rollback(consumed)
        seq.format_phase = phase


def format_prefix(seq: Sequence, drafts: list[int]) -> int:
    """How many of the drafts, from the first, the sequence's output format allows in turn."""
    n = 0
    with drafts_applied(seq) as advance:
        for d in drafts:
            if not advance(d):
                break
            n += 1
    return n
