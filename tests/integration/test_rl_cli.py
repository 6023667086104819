"""`glm5 rl` as a user runs it: worker, gateway and trainer processes, outputs on disk, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SMALL = [
    "--workers", "1", "--worker-arg=--kv-cache-bytes=32MiB", "--worker-arg=--max-model-len=256",
    "--trainer-arg=--group-size=2", "--trainer-arg=--groups-per-step=2", "--trainer-arg=--no-progress",
]  # fmt: skip


def _rl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "glm5_cli", "rl", *SMALL, *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_glm5_rl_writes_checkpoints_history_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _rl("--steps", "2", "--out", str(out), "--trainer-arg=--eval-size=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out accuracy" in proc.stdout and "RL run written to" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_version"] == 2 and summary["trained_samples"] == 2 * 2 * 2
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert len((out / "history.jsonl").read_text().splitlines()) == 2
    assert (out / "rl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "actor_synced" / "v000002" / "tokenizer.json").is_file()


def test_glm5_rl_reports_a_bad_trainer_setting(tmp_path: Path) -> None:
    proc = _rl("--steps", "1", "--out", str(tmp_path), "--trainer-arg=--group-size=1")
    assert proc.returncode == 2
    assert "group_size must be >= 2" in proc.stderr and "the trainer exited with status 2" in proc.stderr
