"""The committed stubs under common/glm5/v1 are exactly what scripts/gen-protos produces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(ROOT / "scripts" / "gen-protos"), str(tmp_path)], check=True, env=env)
    committed = ROOT / "common" / "glm5" / "v1"
    fresh = sorted(p.name for p in (tmp_path / "glm5" / "v1").iterdir())
    assert fresh == sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    stale = [n for n in fresh if (tmp_path / "glm5" / "v1" / n).read_bytes() != (committed / n).read_bytes()]
    assert not stale, f"stale stubs {stale}: run scripts/gen-protos"
    assert all("DO NOT EDIT" in (committed / n).read_text() for n in fresh if n.endswith(".py"))
