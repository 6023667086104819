"""benchmarks/_stale.py (issue 40): every table in docs/benchmarks.md names the commit and date it was measured
at, and tables whose code changed since are listed as stale."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks._stale import ROOT, Marker, Table, dependencies, main, parse, problems, staleness

DOC = """# Benchmarks

## a) One

_Measured at `abcdef1`, 2026-12-01: `data`._

| x | y |
|---|---:|
| 1 | 2 |

| z |
|---|
| 3 |

## b) Two

| w |
|---|
| 4 |
"""


def test_a_marker_covers_the_tables_after_it_up_to_the_next_heading() -> None:
    tables = parse(DOC)
    assert [(t.line, t.section, t.header) for t in tables] == [(7, "a) One", "| x | y |"), (11, "a) One", "| z |"),
                                                               (17, "b) Two", "| w |")]  # fmt: skip
    assert tables[0].marker == tables[1].marker == Marker(5, "abcdef1", "2026-12-01", ("data",))
    assert tables[2].marker is None


def test_every_table_in_the_benchmarks_document_names_an_existing_commit_and_sources() -> None:
    tables = parse((ROOT / "docs" / "benchmarks.md").read_text())
    assert len(tables) > 40
    assert problems(tables) == []


def test_a_benchmark_depends_on_what_it_imports_transitively_and_on_nothing_else() -> None:
    deps = {str(p.relative_to(ROOT)) for p in dependencies(["benchmarks/rl_loop.py"])}
    assert {"benchmarks/rl_loop.py", "benchmarks/_launch.py", "services/trainer/glm5_trainer/loss.py"} <= deps
    assert "common/glm5/errors.py" in deps  # through the trainer's imports, not the script's own
    assert not any(d.startswith(("operator/", "services/router/", "tests/")) for d in deps)


def _git(root: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True, text=True).stdout.strip()


def test_a_table_is_stale_once_commits_changed_its_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("1")
    (tmp_path / "other.txt").write_text("1")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "one")
    measured = _git(tmp_path, "rev-parse", "--short", "HEAD")
    (tmp_path / "other.txt").write_text("2")
    _git(tmp_path, "commit", "-qam", "unrelated")
    marker = Marker(1, measured, "2026-12-01", ("data",))
    table = Table(3, "a) One", "| x |", marker)
    assert staleness(table, tmp_path).changed == ()  # commits landed, none in its sources
    (tmp_path / "data" / "a.txt").write_text("2")
    _git(tmp_path, "commit", "-qam", "related")
    s = staleness(table, tmp_path)
    assert (s.commits_since, s.changed) == (2, ("data/a.txt",))

    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC.replace("abcdef1", measured))
    assert main(["--doc", str(doc), "--commits", "1"], tmp_path) == 0
    listed = capsys.readouterr().out
    assert f"| 7 | a) One | {measured} 2026-12-01 | 2 | data/a.txt | yes |" in listed
    assert "| 17 | b) Two | (no marker) |" in listed
    assert main(["--doc", str(doc), "--commits", "2"], tmp_path) == 0
    assert "| 7 |" not in capsys.readouterr().out  # 2 commits is not more than 2
    assert main(["--doc", str(doc), "--strict"], tmp_path) == 1  # b) has no marker
    assert "line 17 (b) Two): table without" in capsys.readouterr().err
    doc.write_text(DOC.replace("abcdef1", "1234567"))
    assert main(["--doc", str(doc), "--strict"], tmp_path) == 1
    assert "commit 1234567 is not in this repository" in capsys.readouterr().err
