"""The real kopf operator against the kmock Kubernetes emulator (an HTTP server with watch streams).

Writes go through the API (watchers only see API writes); blocking client calls run in a thread so the
emulator, which serves from this test's event loop, is never blocked. kmock quirks handled here: CRDs are
declared with ResourceInfo, test objects carry a uid (the emulator assigns none),
label selectors are ignored by the emulator (the operator filters too), there is no garbage collector,
and resourceVersion/generation are not maintained (VersionedEmulator adds them).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import kmock
import kopf
import pytest_asyncio
from glm5_operator.api import API_VERSION
from glm5_operator.config import OperatorConfig
from glm5_operator.handlers import run
from glm5_operator.kube import Kube, Ref

NS = "default"
CRDS = {
    "glm5.ai/v1alpha1/glm5deployments": kmock.ResourceInfo(
        kind="GLM5Deployment", namespaced=True, singular="glm5deployment", shortnames={"glm5d"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"}, subresources={"status", "scale"},
    ),
    "glm5.ai/v1alpha1/rljobs": kmock.ResourceInfo(
        kind="RLJob", namespaced=True, singular="rljob", shortnames={"rlj"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"}, subresources={"status"},
    ),
}  # fmt: skip
PLURAL = {"GLM5Deployment": "glm5.ai/v1alpha1/glm5deployments", "RLJob": "glm5.ai/v1alpha1/rljobs"}
KEYS = {
    "ConfigMap": "v1/configmaps",
    "Service": "v1/services",
    "Pod": "v1/pods",
    "Event": "v1/events",
    "StatefulSet": "apps/v1/statefulsets",
    "Deployment": "apps/v1/deployments",
    "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
    **PLURAL,
}


@dataclass
class Cluster:
    emulator: kmock.KubernetesEmulator
    kube: Kube
    config: OperatorConfig
    _uids: int = 0
    _operator: threading.Thread | None = field(default=None)
    _stop: threading.Event = field(default_factory=threading.Event)

    # -- the operator -----------------------------------------------------------------------------
    # kopf runs in a thread with its own event loop, as kopf's embedding docs show: on exit it cancels
    # every task it did not start in its loop, which here would include the emulator's connection handlers.

    async def start_operator(self) -> None:
        url = str(self.emulator.url).rstrip("/")

        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, insecure=True)

        ready, self._stop = threading.Event(), threading.Event()

        def main() -> None:
            asyncio.run(run(self.config, kube=lambda: Kube.for_server(url), login=login, ready_flag=ready,
                            stop_flag=self._stop))  # fmt: skip

        self._operator = threading.Thread(target=main, name="kopf", daemon=True)
        self._operator.start()
        assert await asyncio.to_thread(ready.wait, 30), "the operator did not start"

    async def stop_operator(self) -> None:
        if self._operator is not None:
            self._stop.set()
            await asyncio.to_thread(self._operator.join, 60)
            assert not self._operator.is_alive(), "the operator did not stop"
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


class VersionedEmulator(kmock.KubernetesEmulator):
    """The emulator plus what the API server does on every write and kopf relies on: a new resourceVersion
    (kopf tells its own patches' echoes from fresh events by it) and, on spec changes, metadata.generation+1."""

    _versions = itertools.count(100)

    async def _handle(self, request: kmock.Request) -> Any:
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            if request.action == kmock.action.CREATE:
                data.setdefault("metadata", {}).setdefault("generation", 1)
            if request.action in (kmock.action.CREATE, kmock.action.UPDATE):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = str(next(self._versions))
                if request.action == kmock.action.UPDATE and "spec" in data and not request.subresource:
                    with contextlib.suppress(KeyError, ValueError):
                        live = self.objects[request.resource, request.namespace, request.name]
                        meta["generation"] = int(live.get("metadata", {}).get("generation", 1)) + 1
        return await super()._handle(request)


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with VersionedEmulator() as emulator, kmock.Server(emulator):
        emulator.resources.load_bundled()
        for key, info in CRDS.items():
            emulator.resources[key] = info
        c = Cluster(emulator, Kube.for_server(str(emulator.url).rstrip("/")), OperatorConfig(retry_delay_s=0.3))
        await c.start_operator()
        try:
            yield c
        finally:
            await c.stop_operator()
