"""What an RL run leaves in its output folder besides the checkpoints: `history.jsonl` (one row per step),
`summary.json` (the result and the run's settings) and the plot `rl.png`. Users share these files: the settings
go through `public_view`, so the engines' tokens appear as "***" and a Redis URL without its password."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from glm5.security import public_view

if TYPE_CHECKING:
    from glm5_trainer.config import Result, RLConfig


def write_outputs(out: Path, result: Result, config: RLConfig) -> None:
    with (out / "history.jsonl").open("w") as f:
        for row in result.history:
            f.write(json.dumps(row) + "\n")
    summary = {k: v for k, v in asdict(result).items() if k != "history"}
    summary["config"] = public_view(config)  # never asdict(config): the tokens in it are the workers' credentials
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    from glm5_trainer.plot import plot

    plot(result.history, result.accuracy_before, result.accuracy_after, out / "rl.png",
         title=f"{config.environment} · {config.mode} RL")  # fmt: skip
