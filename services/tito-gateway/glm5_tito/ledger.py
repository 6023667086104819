"""The token ledger of one rollout: every token in order, who produced it (model or environment), the
rollout logprob and weight version of model tokens. A new turn must extend what was recorded."""

from __future__ import annotations

from dataclasses import dataclass, field

from glm5.errors import InvalidRequestError


class LedgerMismatch(InvalidRequestError):
    """The caller's context does not extend the recorded tokens (e.g. a chat template rewrote a turn)."""


@dataclass
class Ledger:
    rollout_id: str
    key: int
    group_id: str
    rank: str = ""
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    prompt_tokens: int = 0

    def extend_context(self, context: list[int]) -> int:
        """Record the context's new (environment) tokens; returns how many. Raises LedgerMismatch naming the
        first position that differs from the ledger."""
        n = len(self.tokens)
        if len(context) < n or context[:n] != self.tokens:
            at = next(
                (i for i, (a, b) in enumerate(zip(context, self.tokens, strict=False)) if a != b), min(len(context), n)
            )
            raise LedgerMismatch(
                "context_token_ids",
                f"rollout {self.rollout_id!r}: the context does not extend the recorded {n} tokens (first difference "
                f"at position {at}); send the recorded tokens unchanged and append the new ones",
            )
        new = context[n:]
        if not self.tokens:
            self.prompt_tokens = len(new)
        self.tokens += new
        self.mask += [0] * len(new)
        self.logprobs += [0.0] * len(new)
        self.token_versions += [0] * len(new)
        return len(new)

    def add_generated(self, ids: list[int], logprobs: list[float], version: int) -> None:
        self.tokens += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.token_versions += [version] * len(ids)
