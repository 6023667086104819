"""Speculative decoding: a cheap proposer drafts up to k tokens per sequence, one target forward verifies them
all, and the standard rejection rule keeps the output distributed exactly as without speculation.

Proposers (vLLM's `--speculative-config` methods and keys):
- `mtp`: the checkpoint's multi-token-prediction layer(s) (glm5.model.model.MTPLayer), one layer applied
  recursively for k > 1. The engine runs it over every position the target computes, so its own KV rows (cache
  layer index L + i) follow the sequence; those rows only shape drafts, never what is accepted.
- `auto` (the worker's default): `mtp` with config.AUTO_SPECULATIVE_TOKENS drafts where the checkpoint stores an MTP
  layer and the worker runs on an accelerator, else no speculation (glm5_worker.resolved decides at start-up). On
  a CPU every verify row and MTP pass costs a share of the step: with the demo model's trained layer speculation
  gave 0.48-0.55x the tokens/s at batch 1 (docs/benchmarks.md r), so there it is asked for, not assumed.

Under tensor parallelism the verify rows are decode rows of the step every rank runs, and each MTP pass is sent to
the other ranks (parallel.protocol.Draft: which rows of the replicated hidden states it reads); only rank 0 picks
drafts and accepts.
- `ngram`: prompt lookup (vLLM's `ngram`): the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min). No weights: it pays on
  outputs that copy their context (code edits, quotes, extraction).

The verify step: a decoding sequence with j drafts puts j + 1 rows into the step (its last token, then the drafts),
each a decode row over the same block table with its own context length, so every row reads the KV the rows
before it wrote in the same step and the decode kernels (and compiled graphs) serve it unchanged.

Acceptance (Leviathan et al. 2023; Chen et al. 2023): greedy requests keep the longest prefix of drafts equal to
the target's argmax and then the target's own token; sampled ones accept draft d at row i with probability
min(1, p_i(d) / q_i(d)) and on the first rejection draw from the normalised residual max(0, p_i - q_i); when every
draft is accepted one more token comes from the last row. p is the target's distribution after temperature,
top-k and top-p, q the proposer's (one-hot for ngram and greedy MTP drafts). Under a structured output format
every verify row is masked as the format stands after the drafts before it (the matcher advanced through them,
then rolled back; the emitted tokens then advance it as any token does), and a greedy request's drafts are cut
at the first one the format refuses; a sampled request's stay, the refused one rejected by the rule (p = 0), so
the law is unchanged. Requests whose next-token rule depends on the tokens before it in other ways (penalties,
logit bias, min_tokens) decode one token per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm5_worker.engine.sampler import Sampler, token_logprob
from glm5_worker.engine.sequence import Sequence, TokenLogprob


def can_speculate(seq: Sequence) -> bool:
    """Whether the sequence's next tokens may come several at a time: its sampling rule is the same at every
    position of a step (module docstring)."""
    p = seq.params
    return (
        p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and not p.logit_bias
        and len(seq.output_ids) >= p.min_tokens
    )


def draft_budget(seq: Sequence, k: int, max_model_len: int) -> int:
    """Drafts worth proposing: the verify step emits up to j + 1 tokens and writes positions up to n - 1 + j."""
    left = seq.params.max_new_tokens - len(seq.output_ids)
    return max(0, min(k, left - 1, max_model_len - seq.num_tokens))


def ngram_drafts(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup: the up to k tokens after the latest earlier occurrence of the longest suffix (n_max down to
    n_min tokens) that occurred before."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n :]
        for start in range(total - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@dataclass(slots=True)
class SpecCounters:
    """vLLM's spec_decode counters: drafted and accepted tokens, accepted by draft position, verify steps."""

    k: int
    method: str = "mtp"
    steps: int = 0  # sequence-steps that verified at least one draft
    drafted: int = 0
    accepted: int = 0
    by_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.by_position = [0] * self.k

    def snapshot(self) -> SpecCounters:
        """A copy for another thread (GetStats answers from the gRPC loop while the engine thread counts on)."""
        copy = SpecCounters(self.k, self.method, self.steps, self.drafted, self.accepted)
        copy.by_position = list(self.by_position)
        return copy

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(accepted):
            self.by_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step: accepted drafts plus the target's own token."""
        return 1.0 + self.accepted / self.steps if self.steps else 0.0


def _uniform(seq: Sequence, sampler: Sampler) -> float:
    gen = seq.generator if seq.generator is not None else sampler.generator
    return float(torch.rand(1, generator=gen, dtype=torch.float64))


def _draw(probs: torch.Tensor, seq: Sequence, sampler: Sampler) -> int:
    """One token from a (V,) distribution by inverse CDF, from the request's generator when it has a seed."""
    cdf = probs.double().cumsum(0)
    picked = int(torch.searchsorted(cdf, _uniform(seq, sampler) * cdf[-1], right=True).clamp(max=len(cdf) - 1))
    return picked if probs[picked] > 0 else int(probs.argmax())


def draft_token(logits: torch.Tensor, seq: Sequence, sampler: Sampler) -> tuple[int, torch.Tensor | None]:
    """A proposer's token from its logits (V,): the argmax for a greedy request (q one-hot), else a draw from q,
    the request's sampling distribution applied to them; returns (token, q or None)."""
    if seq.params.is_greedy:
        return int(logits.argmax()), None
    q = sampler.filtered_probs(logits[None].float(), [seq])[0]
    return _draw(q, seq, sampler), q


def verify(
    logits: torch.Tensor,
    drafts: list[int],
    q: list[torch.Tensor | None],
    seq: Sequence,
    sampler: Sampler,
    constrained: torch.Tensor | None = None,
) -> tuple[list[TokenLogprob], int]:
    """The target's logits (j + 1, V) over the verify rows -> the tokens to append (accepted drafts, then the
    target's token) with the target's own logprobs, and how many drafts were accepted. `q[i]`: the proposer's
    distribution of draft i (None: one-hot on it). `constrained`: the rows with an output format's masks, which
    decide (the logprobs are the unmasked ones, as without speculation)."""
    j = len(drafts)
    logits = logits.float()
    decide = logits if constrained is None else constrained
    tokens: list[int] = []
    if seq.params.is_greedy:
        target = decide.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < j and drafts[accepted] == target[accepted]:
            accepted += 1
        tokens = [*drafts[:accepted], target[accepted]]
    else:
        p = sampler.filtered_probs(decide, [seq] * (j + 1))
        accepted = 0
        for i, d in enumerate(drafts):
            qi = q[i]
            qd = 1.0 if qi is None else float(qi[d])
            if qd > 0 and _uniform(seq, sampler) < min(1.0, float(p[i, d]) / qd):
                accepted += 1
                continue
            if qi is None:
                residual = p[i].clone()
                residual[d] = 0.0
            else:
                residual = (p[i] - qi).clamp_(min=0.0)
            # p == q at every token but rounding: the residual is empty, and p itself is the right law
            tokens = [*drafts[:i], _draw(residual if residual.sum() > 0 else p[i], seq, sampler)]
            break
        else:
            tokens = [*drafts, _draw(p[j], seq, sampler)]
    if seq.params.logprobs:
        lp = torch.log_softmax(logits[: len(tokens)], dim=-1)
        picks = [token_logprob(lp[i], t, seq.params.top_logprobs) for i, t in enumerate(tokens)]
    else:
        picks = [TokenLogprob(t, 0.0) for t in tokens]
    return picks, accepted
