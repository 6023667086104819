"""`glm5 rl` as a user runs it: worker, gateway and trainer processes (the trainer as 2 ranks, the policy sharded
over them), outputs on disk, a restart that resumes, clear errors, and no secret in any of it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SMALL = [
    "--workers", "1", "--worker-arg=--kv-cache-bytes=32MiB", "--worker-arg=--max-model-len=256",
    "--trainer-arg=--group-size=2", "--trainer-arg=--groups-per-step=2", "--trainer-arg=--no-progress",
]  # fmt: skip
TOKEN_ENV = ("GLM5_ADMIN_TOKEN", "GLM5_INTERNAL_TOKEN")  # what glm5 rl hands its children (cli/glm5_cli/rl.py)


def _rl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "glm5_cli", "rl", *SMALL, *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@dataclass
class Run:
    out: Path
    returncode: int
    stdout: bytes
    stderr: bytes
    tokens: dict[str, str]  # the run's secrets, read from its children's environment while they ran


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _environment(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(e.decode(errors="replace").partition("=")[::2] for e in raw.split(b"\0") if b"=" in e)


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One short run (the settings above): glm5 rl makes its tokens itself and prints them nowhere, so the test
    reads them from a child's /proc/PID/environ, as only the same user can."""
    base = tmp_path_factory.mktemp("rl")
    out, stdout, stderr = base / "run", base / "stdout", base / "stderr"
    cmd = [sys.executable, "-m", "glm5_cli", "rl", *SMALL, "--steps", "2", "--out", str(out),
           "--trainer-arg=--eval-size=8", "--trainer-nproc", "2"]  # fmt: skip
    with stdout.open("wb") as o, stderr.open("wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e)
        tokens: dict[str, str] = {}
        deadline = time.monotonic() + 300
        try:
            while proc.poll() is None and len(tokens) < len(TOKEN_ENV) and time.monotonic() < deadline:
                for child in _children(proc.pid):
                    env = _environment(child)
                    tokens.update({k: env[k] for k in TOKEN_ENV if env.get(k)})
                time.sleep(0.2)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return Run(out, proc.returncode, stdout.read_bytes(), stderr.read_bytes(), tokens)


def test_glm5_rl_writes_checkpoints_history_and_plot(rl_run: Run) -> None:
    out = rl_run.out
    assert rl_run.returncode == 0, rl_run.stderr[-3000:].decode(errors="replace")
    stdout = rl_run.stdout.decode()
    assert "held-out accuracy" in stdout and "RL run written to" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_version"] == 2 and summary["trained_samples"] == 2 * 2 * 2
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert len((out / "history.jsonl").read_text().splitlines()) == 2
    assert (out / "rl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "actor_synced" / "v000002" / "tokenizer.json").is_file()
    # the workers' and the gateway's output, kept off the terminal once the trainer's progress bar runs
    assert "worker serving" in (out / "logs" / "worker-0.log").read_text()
    assert "TITO gateway on" in (out / "logs" / "tito-gateway.log").read_text()
    assert b"glm5 rl: starting the trainer" in rl_run.stderr
    # two trainer ranks: each holds about half the policy's state, and they published each version together
    trainer = summary["trainer"]
    assert trainer["world_size"] == 2 and len(trainer["rank_bytes"]) == 2
    per_rank = [b["parameters"] + b["gradients"] + b["optimizer"] for b in trainer["rank_bytes"]]
    assert max(per_rank) <= 1.1 * sum(per_rank) / 2, per_rank
    read = [b["checkpoint_read"] for b in trainer["rank_bytes"]]  # each rank read its half of the files
    assert max(read) <= 0.6 * sum(read), read
    published = out / "actor_synced" / "v000002"
    assert (
        len(list(published.glob("model-*.safetensors"))) >= 2 and (published / "model.safetensors.index.json").is_file()
    )
    assert (out / "trainer_state" / ".metadata").is_file() and (out / "trainer_state" / "version").read_text() == "2\n"


def test_a_restarted_2_rank_trainer_resumes_with_its_sharded_state(rl_run: Run) -> None:
    """glm5 rl again on the same folder (what a restarted RLJob trainer pod does): the ranks load the DCP state
    saved with the last version, take the one step left of --steps 3, and the engines serve version 3."""
    assert rl_run.returncode == 0, rl_run.stderr[-3000:].decode(errors="replace")
    proc = _rl("--steps", "3", "--out", str(rl_run.out), "--trainer-arg=--eval-size=4", "--trainer-nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from version 2" in proc.stderr and "with its optimizer state" in proc.stderr
    summary = json.loads((rl_run.out / "summary.json").read_text())
    assert summary["final_version"] == 3 and summary["trainer"]["world_size"] == 2
    assert len((rl_run.out / "history.jsonl").read_text().splitlines()) == 1  # the one step left
    assert (rl_run.out / "trainer_state" / "version").read_text() == "3\n"


def test_no_output_of_glm5_rl_holds_its_tokens(rl_run: Run) -> None:
    """The admin and internal tokens are the workers' credentials: summary.json once held the admin token in plain
    text (dataclasses.asdict of the trainer's config). Every file under --out (JSON, logs, checkpoints, the
    optimizer state, the plot: as bytes) and the command's own stdout and stderr are searched for both."""
    assert rl_run.returncode == 0, rl_run.stderr[-3000:].decode(errors="replace")
    assert set(rl_run.tokens) == set(TOKEN_ENV) and all(len(t) >= 32 for t in rl_run.tokens.values())
    files = [p for p in rl_run.out.rglob("*") if p.is_file()]
    assert {"summary.json", "history.jsonl", "rl.png", "worker-0.log", ".metadata"} <= {p.name for p in files}
    assert any(p.suffix == ".safetensors" for p in files) and any(p.suffix == ".distcp" for p in files)
    outputs = {str(p.relative_to(rl_run.out)): p.read_bytes() for p in files}
    outputs |= {"stdout": rl_run.stdout, "stderr": rl_run.stderr}
    for name, token in rl_run.tokens.items():
        leaked = [where for where, data in outputs.items() if token.encode() in data]
        assert not leaked, f"{name} written to {leaked}"
    config = json.loads((rl_run.out / "summary.json").read_text())["config"]
    assert config["admin_token"] == config["internal_token"] == "***"  # that one was set, never what it is


def test_glm5_rl_reports_a_bad_trainer_setting(tmp_path: Path) -> None:
    proc = _rl("--steps", "1", "--out", str(tmp_path), "--trainer-arg=--group-size=1")
    assert proc.returncode == 2
    assert "group_size must be >= 2" in proc.stderr and "the trainer exited with status 2" in proc.stderr
