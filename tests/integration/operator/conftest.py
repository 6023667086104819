"""The real kopf operator against the kmock Kubernetes emulator (an HTTP server with watch streams).

See tests/helpers/kube.py for the emulator. Writes go through the API (watchers only see API writes); blocking
client calls run in a thread so the emulator, which serves from this test's event loop, is never blocked.
Test objects carry a uid (the emulator assigns none; ownerReferences need it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import kmock
import pytest_asyncio
from glm5_operator.api import API_VERSION
from glm5_operator.config import OperatorConfig
from glm5_operator.kube import Kube, Ref

from tests.helpers.kube import OperatorThread, emulated_cluster

NS = "default"
PLURAL = {"GLM5Deployment": "glm5.ai/v1alpha1/glm5deployments", "RLJob": "glm5.ai/v1alpha1/rljobs"}
KEYS = {
    "ConfigMap": "v1/configmaps",
    "Service": "v1/services",
    "Pod": "v1/pods",
    "Event": "v1/events",
    "StatefulSet": "apps/v1/statefulsets",
    "Deployment": "apps/v1/deployments",
    "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
    "PersistentVolumeClaim": "v1/persistentvolumeclaims",
    "HorizontalPodAutoscaler": "autoscaling/v2/horizontalpodautoscalers",
    "ScaledObject": "keda.sh/v1alpha1/scaledobjects",
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1/leaderworkersets",
    **PLURAL,
}


@dataclass
class Cluster:
    emulator: kmock.KubernetesEmulator
    kube: Kube
    config: OperatorConfig
    _uids: int = 0
    _operator: OperatorThread | None = field(default=None)

    # -- the operator -----------------------------------------------------------------------------

    async def start_operator(self) -> None:
        self._operator = await OperatorThread.start(self.config, str(self.emulator.url).rstrip("/"))

    async def stop_operator(self) -> None:
        if self._operator is not None:
            await self._operator.stop()
            self._operator = None

    # -- API writes (what kubectl would do) ---------------------------------------------------------

    async def apply_cr(self, kind: str, name: str, spec: dict[str, Any]) -> None:
        self._uids += 1
        body = {
            "apiVersion": API_VERSION,
            "kind": kind,
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}-{self._uids}", "labels": {"team": "ml"}},
            "spec": spec,
        }  # fmt: skip
        await asyncio.to_thread(self.kube.create, body)

    async def patch_spec(self, kind: str, name: str, spec_patch: dict[str, Any]) -> None:
        await asyncio.to_thread(self.kube.patch, Ref(*_api(kind), NS, name), {"spec": spec_patch})

    async def patch(self, kind: str, name: str, body: dict[str, Any], subresource: str | None = None) -> None:
        await asyncio.to_thread(self.kube.patch, Ref(*_api(kind), NS, name), body, subresource)

    async def scale(self, name: str, replicas: int) -> None:
        """Write the GLM5Deployment's scale subresource, as `kubectl scale` and autoscalers do (a merge patch: the
        emulator takes no PUT)."""
        ref = Ref(API_VERSION, "GLM5Deployment", NS, name)
        await asyncio.to_thread(self.kube.patch, ref, {"spec": {"replicas": replicas}}, "scale")

    async def create(self, manifest: dict[str, Any]) -> None:
        await asyncio.to_thread(self.kube.create, manifest)

    async def delete(self, kind: str, name: str) -> None:
        await asyncio.to_thread(self.kube.delete, Ref(*_api(kind), NS, name))

    # -- reads (the emulator's memory) --------------------------------------------------------------

    def exists(self, kind: str, name: str) -> bool:
        try:
            return not self.emulator.objects[KEYS[kind], NS, name].deleted
        except KeyError:
            return False

    def obj(self, kind: str, name: str) -> dict[str, Any]:
        return dict(self.emulator.objects[KEYS[kind], NS, name].raw)

    def versions(self, kind: str, name: str) -> int:
        """How many times the object was written (create + patches)."""
        return sum(1 for v in self.emulator.objects[KEYS[kind], NS, name].history if v is not None)

    def condition(self, kind: str, name: str, type_: str) -> dict[str, Any] | None:
        for c in (self.obj(kind, name).get("status") or {}).get("conditions", []):
            if c["type"] == type_:
                return dict(c)
        return None

    def creates(self, kind: str, name: str) -> int:
        """POST requests the API served for this object (duplicates would show up here)."""
        res = KEYS[kind]
        return sum(
            1
            for r in self.emulator  # every request the emulator served
            if r.method == "POST" and r.resource == res and (r.data or {}).get("metadata", {}).get("name") == name
        )

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [
            dict(o.raw)
            for (res, _, _), o in self.emulator.objects.items()
            if res == "v1/events" and not o.deleted and o.raw.get("reason") == reason
        ]


def _api(kind: str) -> tuple[str, str]:
    key = KEYS[kind]
    return key.rsplit("/", 1)[0], kind


async def eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll until `check()` is truthy (assertion errors count as not yet); fail with the last error."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, KeyError, ValueError, TypeError) as exc:
            last = exc
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster() as emulator:
        c = Cluster(
            emulator,
            Kube.for_server(str(emulator.url).rstrip("/")),
            OperatorConfig(retry_delay_s=0.3, api_recheck_s=0.5),
        )
        await c.start_operator()
        try:
            yield c
        finally:
            await c.stop_operator()
