"""rl.png reads on its own: a y-axis label, whole-number step ticks, and markers when a short run has few points."""

from __future__ import annotations

from pathlib import Path

from glm5_trainer.plot import figure, plot


def _history(steps: int) -> list[dict[str, float | int | None]]:
    return [{"step": s, "reward": 0.5 + 0.01 * s, "accuracy": None} for s in range(1, steps + 1)]


def test_a_short_run_has_markers_integer_step_ticks_and_a_y_label() -> None:
    fig = figure(_history(3), 0.4, 0.6, "addition · async RL")
    (ax,) = fig.axes
    assert ax.get_ylabel()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    reward = next(line for line in ax.get_lines() if line.get_label() == "training reward (batch mean)")
    assert reward.get_marker() not in (None, "None", "", " ")


def test_a_single_step_is_still_drawn(tmp_path: Path) -> None:
    fig = figure(_history(1), None, None, "one step")
    (ax,) = fig.axes
    (reward,) = ax.get_lines()
    assert reward.get_marker() not in (None, "None", "", " ")  # a one-point line without a marker is invisible
    plot(_history(1), None, None, tmp_path / "rl.png", "one step")
    assert (tmp_path / "rl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_long_run_is_a_plain_line() -> None:
    fig = figure(_history(200), 0.4, 0.6, "long")
    reward = next(line for line in fig.axes[0].get_lines() if line.get_label() == "training reward (batch mean)")
    assert reward.get_marker() in (None, "None", "", " ")
