"""The shipped demo model (common/glm5/assets/glm5-tiny-addition): it is the default, it loads in our engine,
and it adds numbers it never saw in training (held-out pairs)."""

from __future__ import annotations

import json

from glm5.model.presets import SHIPPED_MODEL, default_model_path
from glm5_cli.demo import evaluate


def test_shipped_model_is_the_default_and_solves_held_out_additions() -> None:
    assert default_model_path() == SHIPPED_MODEL
    meta = json.loads((SHIPPED_MODEL / "training.json").read_text())
    assert sum(f.stat().st_size for f in SHIPPED_MODEL.iterdir()) <= 20 << 20  # ships in the repository
    accuracy = evaluate(SHIPPED_MODEL, meta["max_operand"], meta["held_out"], meta["seed"], limit=100)
    assert accuracy >= 0.95, accuracy  # 100% on all 500 held-out pairs: see docs/benchmarks.md (g)
