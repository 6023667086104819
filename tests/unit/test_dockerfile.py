"""Dockerfile.worker (hadolint, structure, the entrypoint it runs) and the tool-sandbox seccomp profile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile.worker"
PROFILE = ROOT / "deploy" / "seccomp" / "glm5-tool-sandbox.json"
VENV_BIN = Path(sys.executable).parent


def test_hadolint_is_clean() -> None:
    hadolint = VENV_BIN / "hadolint"
    result = subprocess.run([str(hadolint), "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def _stages() -> list[list[str]]:
    stages: list[list[str]] = []
    for line in re.sub(r"\\\n", " ", DOCKERFILE.read_text()).splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            stages.append([])
        if stages and line and not line.startswith("#"):
            stages[-1].append(line)
    return stages


def test_multi_stage_non_root_without_build_tools() -> None:
    stages = _stages()
    assert len(stages) >= 2
    final = stages[-1]
    assert "USER 1001:1001" in final
    assert any("--uid 1001" in line for line in final)
    assert not any(re.search(r"apt-get install|gcc|build-essential|pip install", line) for line in final)
    assert any(line.startswith("COPY --from=build") for line in final)
    text = DOCKERFILE.read_text()
    assert "ARG ACCELERATOR" in text and "torch_npu" in text and "ARG BASE_IMAGE" in text


def test_copied_paths_exist() -> None:
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            *sources, _ = line.split()[1:]
            for src in sources:
                assert (ROOT / src).exists(), src


def test_entrypoint_runs_glm5() -> None:
    entry = ROOT / "docker" / "entrypoint.sh"
    assert os.access(entry, os.X_OK)
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "GLM5_ACCELERATOR": "ascend"}
    for command, flag in (("worker", "--kv-cache-bytes"), ("router", "--token-budget"), ("operator", "--namespace")):
        result = subprocess.run([str(entry), command, "--help"], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        assert flag in result.stdout


SANDBOX = """
import errno, json, os, sys
import pyseccomp as seccomp
profile = json.load(open(sys.argv[1]))
assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
f = seccomp.SyscallFilter(seccomp.ALLOW)
for group in profile["syscalls"]:
    assert group["action"] == "SCMP_ACT_ERRNO"
    for name in group["names"]:
        try:
            f.add_rule(seccomp.ERRNO(group["errnoRet"]), name)
        except Exception:
            pass  # a syscall this kernel/libseccomp does not know (e.g. fchmodat2 on older ones)
f.load()
path = sys.argv[2]
with open(path, "w") as fh:
    fh.write("ok")  # ordinary file work still succeeds
for call in (lambda: os.chmod(path, 0o4755), lambda: os.chown(path, os.getuid(), os.getgid())):
    try:
        call()
        print("ALLOWED")
    except PermissionError as exc:
        assert exc.errno == errno.EPERM
        print("DENIED")
print(open(path).read())
"""


def test_seccomp_profile_denies_chmod_and_chown(tmp_path: Path) -> None:
    profile = json.loads(PROFILE.read_text())
    denied = {n for g in profile["syscalls"] for n in g["names"]}
    assert {"chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat"} <= denied
    target = tmp_path / "tool-output.sh"
    result = subprocess.run([sys.executable, "-c", SANDBOX, str(PROFILE), str(target)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["DENIED", "DENIED", "ok"]
    assert not os.stat(target).st_mode & 0o4111  # the chmod really did not happen
