"""The inside of a test pod's private mount namespace (issue 18's pod runner starts it under `unshare --mount
--propagation private`): mounts the pod's volumes at their mountPaths, its /etc/hosts over the machine's, then
execs the container's command. Nothing it mounts is visible outside the namespace.

A mountPath may not exist on this machine (/etc/glm5/engine, /models/...). Its first missing directory is created
once on the machine (empty) and covered inside the namespace by a fresh tmpfs; the rest of the path is made in
that tmpfs. So inside the pod, under such a directory, exactly what the pod mounts exists: a path its pod does
not mount is absent, as in a container.

    python -m tests.helpers.podns SPEC.json     (SPEC: {"mounts": [...], "hosts": path, "argv": [...],
                                                 "env": {...}, "cwd": path, "keep": [paths]})
a mount is {"source": host path, "target": path in the pod, "read_only": bool, "file": bool}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def _mount(*args: str) -> None:
    # --no-canonicalize: mount(8) would otherwise resolve /proc/<pid>/fd/N to the path it names, which inside
    # the namespace may be another directory (or a directory just made at that path)
    subprocess.run(["mount", "--no-canonicalize", *args], check=True)


REGISTRY = Path("/run/glm5-podns-created")  # mount points this harness created on the machine


def created() -> set[str]:
    return set(REGISTRY.read_text().split("\n")) if REGISTRY.exists() else set()


def first_missing(target: Path, made: set[str]) -> Path | None:
    """The first component of `target` that the machine itself does not have (None when all of it exists). A
    directory an earlier pod made as a mount point counts as missing: every pod covers it afresh."""
    path = Path("/")
    for part in target.parts[1:]:
        path = path / part
        if not path.exists() or str(path) in made:
            return path
    return None


def _held(path: str) -> str:
    """A name for `path` that survives mounts over it: a pod's /tmp volume may cover where its other volumes'
    directories live, so each source is opened first and mounted through /proc/<pid>/fd."""
    return f"/proc/{os.getpid()}/fd/{os.open(path, os.O_PATH)}"


def apply_mounts(mounts: list[dict[str, Any]]) -> None:
    mounts = [{**m, "source": _held(m["source"])} for m in mounts]
    covered: set[Path] = set()
    made = created()
    for m in sorted(mounts, key=lambda m: len(Path(m["target"]).parts)):  # parents before children
        target = Path(m["target"])
        missing = first_missing(target, made)
        if missing is not None and not any(missing.is_relative_to(c) for c in covered):
            is_file = bool(m.get("file")) and missing == target
            if not missing.exists():  # on the machine: an empty mount point, recorded for the other pods
                missing.touch() if is_file else missing.mkdir()
                with REGISTRY.open("a") as f:
                    f.write(f"{missing}\n")
                made.add(str(missing))
            if not is_file:  # a file mount point is simply bound over
                _mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", str(missing))
                covered.add(missing)
        if m.get("file"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch(exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
        _mount("--bind", m["source"], str(target))
        if m.get("read_only"):
            _mount("-o", "remount,bind,ro", str(target))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    hosts = _held(spec["hosts"]) if spec.get("hosts") else None
    keep = {path: _held(path) for path in spec.get("keep", [])}
    apply_mounts(spec.get("mounts", []))
    # this checkout (and its virtualenv) stays where it is: the pod's program runs from it, and a volume at /tmp
    # would otherwise hide a checkout under /tmp
    for path, held in keep.items():
        if any(Path(path).is_relative_to(m["target"]) for m in spec.get("mounts", [])):
            Path(path).mkdir(parents=True, exist_ok=True)
            _mount("--bind", held, path)
    if hosts:
        _mount("--bind", hosts, "/etc/hosts")
    os.chdir(spec.get("cwd") or "/")
    os.execvpe(spec["argv"][0], spec["argv"], spec.get("env") or dict(os.environ))


if __name__ == "__main__":
    main()
