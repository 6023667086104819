"""The engine's decode step times (the latency jitter a worker reports): bounded in count and in age, so a worker
whose jitter once crossed the router's threshold is not marked degraded for good while it sits idle (at low load the
router then sent it nothing: the e2e test's two-worker flake)."""

from __future__ import annotations

import statistics

from glm5_worker.engine.engine import _StepTimes


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_old_step_times_fade_and_the_count_is_bounded() -> None:
    clock = Clock()
    times = _StepTimes(window=4, window_s=30.0, clock=clock)
    for ms in (10.0, 400.0, 10.0, 400.0, 10.0):
        times.add(ms)
    assert times.recent() == [400.0, 10.0, 400.0, 10.0]  # the 4 latest
    assert statistics.pstdev(times.recent()) > 150  # jittery: over the router's default threshold
    clock.t += 29.0
    times.add(12.0)
    clock.t += 2.0  # the first four are now 31 s old
    assert times.recent() == [12.0]
    clock.t += 31.0
    assert times.recent() == []  # an idle worker reports no jitter
