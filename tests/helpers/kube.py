"""A Kubernetes API for tests and benchmarks: the kmock emulator (a real HTTP server with watch streams),
plus what kopf needs from an API server that kmock leaves out, and the operator running in its own thread.

kmock quirks handled here: CRDs are declared with ResourceInfo; resourceVersion and generation are not
maintained by kmock (VersionedEmulator adds them); label selectors are ignored by kmock (the operator
filters too); there is no garbage collector. kopf runs in a thread with its own event loop, as kopf's
embedding docs show: on exit it cancels every task it did not start in its loop, which would otherwise
include the emulator's connection handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator
from typing import Any

import attrs
import kmock
import kopf
from glm5_operator.config import OperatorConfig
from glm5_operator.handlers import run
from glm5_operator.kube import Kube

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


@attrs.define(kw_only=True)
class VersionedEmulator(kmock.KubernetesEmulator):
    """The emulator plus what the API server does on every write and kopf relies on: a new resourceVersion
    (kopf tells its own patches' echoes from fresh events by it) and, on spec changes, metadata.generation+1.

    kmock routes each request by scanning every request it has ever served, so a long run slows down
    quadratically; `request_log` (benchmarks) keeps only that many recent requests (well above the number in
    flight), which makes the emulator's per-request cost flat again.
    """

    request_log: int | None = None
    served: int = 0
    _versions = itertools.count(100)

    async def _handle(self, request: kmock.Request) -> Any:
        self.served += 1
        if self.request_log is not None and len(self._requests) > 2 * self.request_log:
            del self._requests[: -self.request_log]
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


@contextlib.asynccontextmanager
async def emulated_cluster(request_log: int | None = None) -> AsyncIterator[VersionedEmulator]:
    """An emulated API server on a localhost port with the built-in resources and our CRDs."""
    async with VersionedEmulator(request_log=request_log) as emulator, kmock.Server(emulator):
        emulator.resources.load_bundled()
        for key, info in CRDS.items():
            emulator.resources[key] = info
        yield emulator


class OperatorThread:
    """The real operator (`glm5_operator.handlers.run`) against `server`, in a thread of its own."""

    def __init__(self, thread: threading.Thread, stop_flag: threading.Event) -> None:
        self._thread = thread
        self._stop = stop_flag

    @classmethod
    async def start(cls, config: OperatorConfig, server: str) -> OperatorThread:
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=server, insecure=True)

        ready, stop_flag = threading.Event(), threading.Event()

        def main() -> None:
            asyncio.run(run(config, kube=lambda: Kube.for_server(server), login=login, ready_flag=ready,
                            stop_flag=stop_flag))  # fmt: skip

        thread = threading.Thread(target=main, name="kopf", daemon=True)
        thread.start()
        assert await asyncio.to_thread(ready.wait, 30), "the operator did not start"
        return cls(thread, stop_flag)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 60)
        assert not self._thread.is_alive(), "the operator did not stop"
