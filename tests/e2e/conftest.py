"""One emulated cluster per end-to-end test: the kmock API, the real operator (kopf) in its thread, and the pod
runner (tests/helpers/podrunner.py) running what the controllers would, with real `kubectl` in front."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
from glm5_operator.config import OperatorConfig
from glm5_operator.kube import Kube

from tests.helpers.kube import OperatorThread, emulated_cluster, kubectl
from tests.helpers.podrunner import PodRunner

CHART = Path(__file__).resolve().parents[2] / "charts" / "glm5"
EXAMPLES = CHART / "examples"
NAMESPACE = "default"
T = TypeVar("T")
CRASH_LOOP = 5  # restarts of one pod that fail a wait at once
needs_pods = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="pods need root and unshare")


@dataclass
class Cluster:
    emulator: Any
    server: str
    kube: Kube
    runner: PodRunner

    async def kubectl(self, *args: str) -> str:
        return await asyncio.to_thread(kubectl, self.server, *args, namespace=NAMESPACE)

    def get(self, resource: str, name: str) -> dict[str, Any]:
        """The stored object (resource as kmock keys it, e.g. 'batch/v1/jobs'); {} when absent."""
        try:
            obj = self.emulator.objects[resource, NAMESPACE, name]
        except KeyError:
            return {}
        return {} if obj.deleted else dict(obj.raw)

    def secret(self, name: str, key: str) -> str:
        """A key of a stored Secret (data base64-encoded, or stringData as the operator writes it)."""
        import base64

        obj = self.get("v1/secrets", name)
        data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        return {**data, **(obj.get("stringData") or {})}[key]

    def condition(self, resource: str, name: str, kind: str) -> dict[str, Any]:
        conds = (self.get(resource, name).get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == kind), {})

    async def until(self, check: Callable[[], T], timeout: float, what: str) -> T:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            result = check()
            if result:
                return result
            looping = [p.name for p in self.runner.pods.values() if sum(p.restarts.values()) >= CRASH_LOOP]
            if looping:  # a kubelet would back off; nothing will come of waiting
                raise AssertionError(f"waiting for {what}: {looping} keep crashing; pods: {self.runner.describe()}")
            await asyncio.sleep(0.3)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; pods: {self.runner.describe()}")

    async def fill_demo_claims(self) -> None:
        """What a user does first: examples/demo-data.yaml's claims, filled by its Job."""
        await self.kubectl("apply", "-f", str(EXAMPLES / "demo-data.yaml"))
        await self.until(lambda: self.condition("batch/v1/jobs", "glm5-demo-data", "Complete").get("status") == "True",
                         120, "the demo-data Job to complete")  # fmt: skip


@pytest_asyncio.fixture
async def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Cluster]:
    marker = request.node.get_closest_marker("pod_runner")
    crds = request.node.get_closest_marker("installed")  # other projects' CRDs: pytest.mark.installed("lws")
    async with emulated_cluster(installed=tuple(crds.args) if crds else ()) as emulator:
        server = str(emulator.url).rstrip("/")
        kube = Kube.for_server(server)
        operator = await OperatorThread.start(OperatorConfig(retry_delay_s=0.3, progress_interval_s=0.5), server)
        runner = PodRunner(emulator, kube, NAMESPACE, tmp_path, **(marker.kwargs if marker else {}))
        await runner.start()
        try:
            yield Cluster(emulator, server, kube, runner)
        finally:
            await runner.stop()
            await operator.stop()
