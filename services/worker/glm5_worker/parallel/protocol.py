"""What rank 0 sends the other ranks of its replica, in order, over the control channel."""

from __future__ import annotations

from dataclasses import dataclass, field

from glm5_worker.runner.plan import StepPlan
from glm5_worker.runner.weights import WeightSource


@dataclass(slots=True)
class Step:
    plan: StepPlan


@dataclass(slots=True)
class Draft:
    """An MTP pass (ModelRunner.draft) after a step: the first reads the step's hidden states at rows `take`, a
    later one the previous pass's output at rows `keep` (the sequences still drafting)."""

    plan: StepPlan
    step: int
    take: list[int] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Tick:
    """Rank 0 is idle: proof of life (a follower's wait would time out otherwise), plus demotions to apply."""

    demotions: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class LoadWeights:
    """Start reading this rank's shard of new weights in the background (steps go on meanwhile)."""

    source: WeightSource
    tokenizer_fingerprint: str


@dataclass(slots=True)
class SwapWeights:
    """Finish the read; if every rank read its shard, all swap them in (else none does)."""

    version: int


@dataclass(slots=True)
class Stats:
    """Report this rank's memory."""


@dataclass(slots=True)
class Stop:
    pass


Message = Step | Draft | Tick | LoadWeights | SwapWeights | Stats | Stop
