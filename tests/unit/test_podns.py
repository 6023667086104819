"""The test pod runner's mount namespace (tests/helpers/podns.py): volumes appear at their mountPaths, read-only
ones cannot be written, paths the pod does not mount do not exist, and the machine sees none of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")


def test_a_pod_sees_its_mounts_and_nothing_else(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    (config / "engine.json").write_text("{}\n")
    claim = tmp_path / "claim"
    claim.mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.5 tiny-worker tiny-worker.default.svc\n")
    base = Path("/tmp") / f"podns-{uuid.uuid4().hex[:8]}"  # not on this machine yet: a tmpfs covers it in the pod
    script = (f"cat {base}/etc/engine/engine.json && "
              f"test ! -e {base}/etc/other && echo absent && "
              f"(touch {base}/etc/engine/new 2>/dev/null && echo writable || echo read-only) && "
              f"touch {base}/data/out && echo wrote && grep -c tiny-worker /etc/hosts")  # fmt: skip
    spec = {
        "mounts": [
            {"source": str(config), "target": f"{base}/etc/engine", "read_only": True},
            {"source": str(claim), "target": f"{base}/data"},
        ],
        "hosts": str(hosts),
        "argv": ["sh", "-c", script],
        "env": {"PATH": os.environ["PATH"]},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    try:
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-m",
                               "tests.helpers.podns", str(tmp_path / "spec.json")],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["{}", "absent", "read-only", "wrote", "1"]
        assert (claim / "out").exists()  # the claim is the machine's directory, shared
        assert base.is_dir() and not any(base.iterdir())  # the machine sees an empty mount point only
        assert "tiny-worker" not in Path("/etc/hosts").read_text()
        # a second pod mounting only elsewhere under the same directory: the first pod's paths do not exist for it
        other = {"mounts": [{"source": str(claim), "target": f"{base}/var/data"},
                            {"source": str(hosts), "target": f"{base}/dev/termination-log", "file": True}],
                 "argv": ["sh", "-c", f"test ! -e {base}/etc && test -f {base}/dev/termination-log && echo clean"],
                 "env": {"PATH": os.environ["PATH"]}}  # fmt: skip
        (tmp_path / "other.json").write_text(json.dumps(other))
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-m",
                               "tests.helpers.podns", str(tmp_path / "other.json")],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
        assert proc.returncode == 0 and proc.stdout.strip() == "clean", proc.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)
