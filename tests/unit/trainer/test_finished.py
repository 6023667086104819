"""A trainer restarted after its job finished (a StatefulSet restarts every container that exits): each host
reports the completion and exits at once, without starting ranks or meeting a rendezvous, so a trainer over
several pods cannot hang on its hosts coming back at different times."""

from __future__ import annotations

import json
import time
from pathlib import Path

from glm5_cli.main import parse_args
from glm5_trainer.cli import run
from glm5_trainer.config import RLConfig
from glm5_trainer.resume import finished

from tests.helpers.procs import free_port


def _publish(out: Path, version: int, steps: int | None) -> None:
    folder = out / "actor_synced" / f"v{version:06d}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if steps is not None:
        (folder / "version.json").write_text(json.dumps({"version": version, "steps": steps}))


def test_a_finished_job_is_seen_from_its_published_versions(tmp_path: Path) -> None:
    config = RLConfig(policy=tmp_path, gateway="g:1", out=tmp_path / "out", engines=("e:1",), steps=5)
    assert finished(config) is None  # nothing published yet
    _publish(config.out, 3, 4)
    assert finished(config) is None  # 4 of 5 steps
    _publish(config.out, 4, 5)
    (config.out / "actor_synced" / "v000009.tmp").mkdir()  # a half-written version does not count
    assert finished(config) == (4, 5)
    assert finished(RLConfig(policy=tmp_path, gateway="g:1", out=config.out, engines=("e:1",), steps=0)) is None
    _publish(config.out, 6, None)  # published before steps were recorded: one step per version
    assert finished(config) == (6, 6)


def test_every_host_of_a_finished_trainer_exits_without_a_rendezvous(tiny_model: Path, tmp_path: Path) -> None:
    out, done = tmp_path / "out", tmp_path / "termination-log"
    _publish(out, 7, 2)
    # host 1 of 2, its host 0 nowhere: a rendezvous would wait out its 900 s timeout
    argv = ["trainer", "--policy", str(tiny_model), "--gateway", "127.0.0.1:1", "--engine", "127.0.0.1:2",
            "--checkpoint-dir", str(out), "--steps", "2", "--completion-file", str(done), "--nnodes", "2",
            "--node-rank", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port())]  # fmt: skip
    start = time.monotonic()
    run(parse_args(argv))
    assert time.monotonic() - start < 5
    assert json.loads(done.read_text()) == {"complete": True, "steps": 2, "version": 7}
