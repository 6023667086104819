"""Per-layer attention-entropy tracking and the dynamic sparsity controller.

The engine measures the mean entropy (nats) of each layer's sparse attention every few steps. Two
exponential averages per layer give the drift signal the router's breaker watches:
drift = |short - long| / long: the recent entropy against the worker's own running baseline. The baseline
counts only once it has averaged BASELINE_MEASUREMENTS measurements (the long average's own span, a plain
mean until then): before that it is a request or two, so a new worker whose first prompts differ from its next
ones (a chat turn, then a bare "1 + 1") would read as drifting and lose half its traffic to the breaker. It fades
(half-life DRIFT_HALF_LIFE_S) while no new measurement comes: an idle worker has no drift, so a spike from its
last requests cannot keep its router's breaker degraded after the traffic has gone.

The controller (off by default, since it departs from how the model was trained) widens a full-indexer
layer's top-k by `widen_factor` when its entropy stays below `threshold` for `patience` consecutive
measurements, and narrows it back after `patience` measurements at or above it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

DRIFT_HALF_LIFE_S = 5.0
SHORT_ALPHA = 0.3  # the recent entropy: a span of a few measurements
LONG_ALPHA = 0.02  # the baseline: a span of ~50
BASELINE_MEASUREMENTS = round(1 / LONG_ALPHA)


@dataclass(slots=True)
class LayerState:
    topk: int
    entropy_short: float | None = None
    entropy_long: float | None = None
    measurements: int = 0
    below: int = 0
    above: int = 0
    widened: bool = False

    @property
    def drift(self) -> float:
        if self.measurements < BASELINE_MEASUREMENTS or self.entropy_short is None or not self.entropy_long:
            return 0.0
        return abs(self.entropy_short - self.entropy_long) / abs(self.entropy_long)


class SparsityController:
    def __init__(
        self,
        num_layers: int,
        index_topk: int,
        full_layers: list[int],
        enabled: bool,
        threshold: float,
        patience: int,
        widen_factor: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.last_observed = clock()
        self.base_topk = index_topk
        self.full_layers = set(full_layers)
        self.enabled, self.threshold, self.patience, self.widen_factor = enabled, threshold, patience, widen_factor
        self.layers = [LayerState(index_topk) for _ in range(num_layers)]
        self.num_widenings = 0

    def layer_topk(self) -> list[int] | None:
        if not any(s.widened for s in self.layers):
            return None
        return [s.topk for s in self.layers]

    def observe(self, entropy: dict[int, float]) -> None:
        self.last_observed = self.clock()
        for layer, value in entropy.items():
            if not math.isfinite(value):
                continue
            s = self.layers[layer]
            s.measurements += 1
            # the plain mean of what came so far until an average's span is full (a start that is one request's
            # value would weigh in for hundreds of measurements), exponential after
            first = 1 / s.measurements
            short, long = s.entropy_short or 0.0, s.entropy_long or 0.0
            s.entropy_short = short + max(SHORT_ALPHA, first) * (value - short)
            s.entropy_long = long + max(LONG_ALPHA, first) * (value - long)
            if self.enabled and layer in self.full_layers:
                self._control(s, value)

    def _control(self, s: LayerState, value: float) -> None:
        if value < self.threshold:
            s.below, s.above = s.below + 1, 0
        else:
            s.below, s.above = 0, s.above + 1
        if not s.widened and s.below >= self.patience:
            s.widened, s.topk = True, math.ceil(self.base_topk * self.widen_factor)
            self.num_widenings += 1
        elif s.widened and s.above >= self.patience:
            s.widened, s.topk = False, self.base_topk

    @property
    def max_drift(self) -> float:
        fade = float(0.5 ** ((self.clock() - self.last_observed) / DRIFT_HALF_LIFE_S))
        return fade * max((s.drift for s in self.layers), default=0.0)
