"""What rank 0 sends the other ranks of its replica, in order, over the control channel."""

from __future__ import annotations

from dataclasses import dataclass, field

from glm5_worker.engine.model_runner import StepPlan
from glm5_worker.engine.weights import WeightSource


@dataclass(slots=True)
class Step:
    plan: StepPlan


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


Message = Step | Tick | LoadWeights | SwapWeights | Stats | Stop
