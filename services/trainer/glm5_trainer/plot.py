"""The reward/accuracy plot of an RL run (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FEW_POINTS = 30  # runs with at most this many steps get a marker per step


def plot(history: list[dict[str, Any]], before: float | None, after: float | None, out: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(history, before, after, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def figure(history: list[dict[str, Any]], before: float | None, after: float | None, title: str) -> Figure:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a trainer pod
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [r["step"] for r in history]
    rewards = [r["reward"] for r in history]
    # a short run's few points would be a bare line (or nothing, for a single step) without markers
    marker = "o" if len(steps) <= FEW_POINTS else None
    ax.plot(steps, rewards, color="#8aa", lw=1, marker=marker, ms=4, label="training reward (batch mean)")
    window = 5
    if len(rewards) >= window:
        smooth = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]
        ax.plot(steps[window - 1 :], smooth, color="#066", lw=2, label=f"training reward ({window}-step mean)")
    points = [(r["step"], r["accuracy"]) for r in history if r.get("accuracy") is not None]
    if before is not None:
        points.insert(0, (0, before))
    if after is not None:
        points.append((steps[-1] if steps else 0, after))
    if points:
        xs, ys = zip(*sorted(set(points)), strict=True)
        ax.plot(xs, ys, "o-", color="#c50", lw=2, label="held-out accuracy (greedy)")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward / held-out accuracy")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers: no 0.5 ticks on short runs
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig
