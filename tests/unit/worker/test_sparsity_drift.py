"""The attention-entropy drift the router's breaker reads: recent entropy against the worker's own running
baseline, fading while the worker is idle."""

from __future__ import annotations

from glm5_worker.engine.sparsity import BASELINE_MEASUREMENTS, DRIFT_HALF_LIFE_S, SparsityController


def test_drift_rises_with_a_change_and_fades_while_idle() -> None:
    now = [0.0]
    c = SparsityController(2, 8, [], False, 1.0, 3, 2.0, clock=lambda: now[0])
    for _ in range(50):
        c.observe({0: 2.0, 1: 2.0})
        now[0] += 0.1
    assert c.max_drift < 0.01  # a steady workload: no drift against its own baseline
    for _ in range(5):
        c.observe({0: 3.0, 1: 2.0})
    spike = c.max_drift
    assert spike > 0.3
    now[0] += DRIFT_HALF_LIFE_S
    assert abs(c.max_drift - spike / 2) < 1e-9  # one half-life idle: half the drift
    now[0] += 10 * DRIFT_HALF_LIFE_S
    assert c.max_drift < 0.001  # long idle: none, so the breaker's weight comes back


def test_a_new_worker_has_no_drift_until_its_baseline_has_enough_measurements() -> None:
    """A worker's first requests are not a baseline: a chat turn then bare "1 + 1"s (entropy 2 -> 0.7) must not
    halve a fresh replica's share of traffic; the same change after a real baseline does read as drift."""
    c = SparsityController(1, 8, [], False, 1.0, 3, 2.0, clock=lambda: 0.0)
    c.observe({0: 2.0})
    for _ in range(BASELINE_MEASUREMENTS - 2):
        c.observe({0: 0.7})
        assert c.max_drift == 0.0
    c.observe({0: 0.7})  # the baseline is complete: the mean of its measurements, the first one 1/50 of it
    assert c.max_drift < 0.05
    warmed = SparsityController(1, 8, [], False, 1.0, 3, 2.0, clock=lambda: 0.0)
    for _ in range(BASELINE_MEASUREMENTS):
        warmed.observe({0: 2.0})
    warmed.observe({0: 0.7})
    assert warmed.max_drift > 0.12
