"""Which figures in docs/benchmarks.md may be stale (issue 40). Every table there follows a line

    _Measured at `1a2b3c4`, 2026-12-03: `benchmarks/rl_loop.py`._

naming the commit the figures were measured at, the date, and what produced them (benchmark scripts, source
files or folders, comma-separated); a marker covers the tables after it up to the next marker or heading. A table
is listed as stale when more than `--commits` commits have landed since its commit and one of them changed a file
its sources import, transitively, within this repository (the import graph import-linter checks, built by grimp),
so a reader finds old figures that today's code may no longer give rather than remembering them.

    scripts/stale-benchmarks [--commits 20] [--doc docs/benchmarks.md] [--all] [--strict]

`--all` lists every table; `--strict` (scripts/check) fails when a table has no marker or a marker names a commit
or a path that does not exist. Listing stale tables never fails: re-measuring is a decision, not a check.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^_Measured at `([0-9a-f]{7,40})`, (\d{4}-\d{2}-\d{2}): (.+)\._$")
SEPARATOR = re.compile(r"^\|[-:| ]+\|$")


@dataclasses.dataclass(frozen=True)
class Marker:
    line: int  # 1-based
    commit: str
    date: str
    sources: tuple[str, ...]  # repository paths


@dataclasses.dataclass(frozen=True)
class Table:
    line: int  # 1-based, the header row
    section: str
    header: str
    marker: Marker | None


def parse(text: str) -> list[Table]:
    """The tables of a benchmarks document, each with the marker that covers it (None: none does)."""
    lines = text.splitlines()
    tables, section, marker = [], "", None
    for i, line in enumerate(lines):
        if line.startswith("#"):
            section, marker = line.lstrip("#").strip(), None
        elif m := MARKER.match(line):
            sources = tuple(s.strip().strip("`") for s in m.group(3).split(","))
            marker = Marker(i + 1, m.group(1), m.group(2), sources)
        elif (
            line.startswith("|")
            and i + 1 < len(lines)
            and SEPARATOR.match(lines[i + 1])
            and not (i and lines[i - 1].startswith("|"))
        ):
            tables.append(Table(i + 1, section, line, marker))
    return tables


def git(*args: str, root: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def commit_exists(commit: str, root: Path = ROOT) -> bool:
    """True also where the clone is shallow and may simply not hold it (a CI checkout)."""
    if git("rev-parse", "--is-shallow-repository", root=root) == "true":
        return True
    found = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=root, capture_output=True)
    return found.returncode == 0


@cache
def _packages() -> tuple[str, ...]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return tuple(config["tool"]["importlinter"]["root_packages"])


@cache
def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*_packages(), cache_dir=None)


@cache
def _module_file(module: str) -> Path | None:
    root, *rest = module.split(".")
    spec = importlib.util.find_spec(root)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


@cache
def _upstream(module: str) -> frozenset[str]:
    return frozenset({module} | _graph().find_upstream_modules(module))


def _imports(path: Path) -> set[str]:
    """The absolute module names a file imports (for `from a import b`, also `a.b`: it may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def dependencies(sources: Iterable[str], root: Path = ROOT) -> set[Path]:
    """The repository files that the sources are or import, transitively: benchmark scripts by their own imports
    (benchmarks.* helpers too), the project's packages by grimp's graph; folders count with every file in them."""
    files: set[Path] = set()
    todo = [root / s for s in sources]
    packages, known = _packages(), _graph().modules
    while todo:
        path = todo.pop()
        if path in files:
            continue
        if path.is_dir():
            todo.extend(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
            continue
        files.add(path)
        if path.suffix != ".py":
            continue
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "benchmarks":
                helper = root.joinpath(*name.split(".")).with_suffix(".py")
                todo.extend([helper] if helper.is_file() else [])
            elif top in packages and name in known:
                todo.extend(p for m in _upstream(name) if (p := _module_file(m)) is not None)
    return {p.resolve() for p in files if p.resolve().is_relative_to(root.resolve())}


@dataclasses.dataclass(frozen=True)
class Staleness:
    table: Table
    commits_since: int
    changed: tuple[str, ...]  # files among its dependencies changed since its commit


def staleness(table: Table, root: Path = ROOT) -> Staleness:
    assert table.marker is not None
    deps = sorted(str(p.relative_to(root.resolve())) for p in dependencies(table.marker.sources, root))
    since = int(git("rev-list", "--count", f"{table.marker.commit}..HEAD", root=root))
    changed = git("diff", "--name-only", table.marker.commit, "HEAD", "--", *deps, root=root).split() if deps else []
    return Staleness(table, since, tuple(changed))


def problems(tables: Sequence[Table], root: Path = ROOT) -> list[str]:
    """What --strict refuses: tables without a marker, markers naming a commit or a path that does not exist."""
    out = []
    for t in tables:
        if t.marker is None:
            out.append(f"line {t.line} ({t.section}): table without a `_Measured at ...` line above it")
            continue
        if not commit_exists(t.marker.commit, root):
            out.append(f"line {t.marker.line}: commit {t.marker.commit} is not in this repository")
        out.extend(f"line {t.marker.line}: {s} does not exist" for s in t.marker.sources if not (root / s).exists())
    return sorted(set(out))


def main(argv: Sequence[str] | None = None, root: Path = ROOT) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc", type=Path, default=root / "docs" / "benchmarks.md", help="the benchmarks document")
    p.add_argument("--commits", type=int, default=20, help="list tables measured more than this many commits ago")
    p.add_argument("--all", action="store_true", help="list every table, stale or not")
    p.add_argument("--strict", action="store_true", help="fail on a table without a marker or a broken marker")
    a = p.parse_args(argv)
    tables = parse(a.doc.read_text())
    if a.strict:
        found = problems(tables, root)
        for line in found:
            print(f"{a.doc.name}: {line}", file=sys.stderr)
        return 1 if found else 0
    print("| line | section | measured | commits since | changed dependencies | stale |")
    print("|---:|---|---|---:|---|---|")
    cached: dict[Marker, Staleness] = {}
    for t in tables:
        if t.marker is None:
            print(f"| {t.line} | {t.section[:40]} | (no marker) | | | ? |")
            continue
        s = cached.get(t.marker) or cached.setdefault(t.marker, staleness(t, root))
        stale = s.commits_since > a.commits and bool(s.changed)
        if stale or a.all:
            shown = ", ".join(s.changed[:3]) + (f" (+{len(s.changed) - 3})" if len(s.changed) > 3 else "")
            print(f"| {t.line} | {t.section[:40]} | {t.marker.commit} {t.marker.date} | {s.commits_since} | "
                  f"{shown or '-'} | {'yes' if stale else 'no'} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
