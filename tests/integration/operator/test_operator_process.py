"""`glm5 operator` as a real process: kubeconfig login, /healthz, reconcile, clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers.procs import free_port, stop
from tests.integration.operator.conftest import Cluster, eventually

pytestmark = pytest.mark.asyncio


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


async def test_glm5_operator_process(cluster: Cluster, tmp_path: Path) -> None:
    await cluster.stop_operator()  # this test's operator is the process
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": str(cluster.emulator.url).rstrip("/")}}],
        "users": [{"name": "dev", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "dev", "namespace": "default"}}],
    }))  # fmt: skip
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "GLM5_IMAGE": "registry.local/glm5:test"}
    cmd = [sys.executable, "-m", "glm5_cli", "operator", "--health-port", str(port)]
    log = tmp_path / "operator.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        await eventually(lambda: _healthy(port) or proc.poll() is not None, timeout=60, what="/healthz")
        assert proc.poll() is None, log.read_text()
        await cluster.apply_cr("GLM5Deployment", "tiny", {"model": {"path": "/m"}})
        await eventually(lambda: cluster.exists("StatefulSet", "tiny-worker"), timeout=30, what="worker StatefulSet")
        image = cluster.obj("StatefulSet", "tiny-worker")["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == "registry.local/glm5:test"
    finally:
        code = await asyncio.to_thread(stop, proc)
    assert code == 0, log.read_text()[-3000:]
