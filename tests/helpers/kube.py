"""A Kubernetes API for tests and benchmarks: the kmock emulator (a real HTTP server with watch streams),
plus what kopf needs from an API server that kmock leaves out, and the operator running in its own thread.

kmock quirks handled here: CRDs are declared with ResourceInfo; resourceVersion, generation and uid are not
maintained by kmock (VersionedEmulator adds them); label selectors are ignored by kmock (the operator
filters too); there is no garbage collector. kopf runs in a thread with its own event loop, as kopf's
embedding docs show: on exit it cancels every task it did not start in its loop, which would otherwise
include the emulator's connection handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import os
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp.web
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
# CRDs of other projects a test may install (what `kubectl apply` of their CRDs does): LeaderWorkerSet, KEDA
OPTIONAL_CRDS = {
    "lws": ("leaderworkerset.x-k8s.io/v1/leaderworkersets", kmock.ResourceInfo(
        kind="LeaderWorkerSet", namespaced=True, singular="leaderworkerset", shortnames={"lws"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"}, subresources={"status", "scale"})),
    "keda": ("keda.sh/v1alpha1/scaledobjects", kmock.ResourceInfo(
        kind="ScaledObject", namespaced=True, singular="scaledobject", shortnames={"so"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"}, subresources={"status"})),
}  # fmt: skip
# The CRDs' scale subresources (charts/glm5/crds): plural -> (specReplicasPath, statusReplicasPath, labelSelectorPath)
SCALE = {"glm5deployments": (("spec", "workers", "replicas"), ("status", "readyReplicas"), ("status", "selector"))}
# kmock applies no schema defaults: the CRD's for specReplicasPath (workers defaults to {}, so it always applies)
SCALE_DEFAULT = {"glm5deployments": 1}


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = (obj or {}).get(key)
    return obj


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
        if request.subresource == "scale" and request.resource is not None and request.resource.plural in SCALE:
            return await self._scale(request)
        if self.request_log is not None and len(self._requests) > 2 * self.request_log:
            del self._requests[: -self.request_log]
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            if request.action == kmock.action.CREATE:
                meta = data.setdefault("metadata", {})
                meta.setdefault("generation", 1)
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            if request.action in (kmock.action.CREATE, kmock.action.UPDATE):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = str(next(self._versions))
                if request.action == kmock.action.UPDATE and "spec" in data and not request.subresource:
                    with contextlib.suppress(KeyError, ValueError):
                        live = self.objects[request.resource, request.namespace, request.name]
                        meta["generation"] = int(live.get("metadata", {}).get("generation", 1)) + 1
        return await super()._handle(request)

    async def _serve_version(self, request: kmock.Request) -> Any:
        """kmock names the core group's version '/v1'; kubectl then finds no core kinds (PVCs, Pods...)."""
        served = await super()._serve_version(request)
        served["groupVersion"] = served["groupVersion"].lstrip("/")
        return served

    async def _serve_list(self, request: kmock.Request) -> Any:
        """Lists with their kind and apiVersion, which kubectl needs to print them."""
        served = await super()._serve_list(request)
        assert request.resource is not None
        info = self.resources.get(request.resource)
        if info is not None and info.kind:
            group, version = request.resource.group, request.resource.version
            served |= {"kind": f"{info.kind}List", "apiVersion": f"{group}/{version}" if group else version}
        return served

    def _live(self, key: tuple[Any, str | None, str | None]) -> Any:
        """The stored object, or None (kmock's ObjectsArray has `in` and `[]` but no `get`)."""
        return self._objects[key] if key in self._objects else None  # noqa: SIM401

    async def _scale(self, request: kmock.Request) -> aiohttp.web.Response:
        """The scale subresource as the API server serves it for a CRD (what `kubectl scale` and autoscalers use):
        an autoscaling/v1 Scale read from, and written to, the paths the CRD declares."""
        assert request.resource is not None and request.resource.plural is not None
        spec_path, status_path, selector_path = SCALE[request.resource.plural]
        key = (request.resource, request.namespace, request.name)
        if request.action == kmock.action.UPDATE:
            replicas = _dig(request.data, ("spec", "replicas"))
            if not isinstance(replicas, int) or replicas < 0:
                return aiohttp.web.json_response(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "reason": "Invalid",
                        "code": 422,
                        "message": "spec.replicas: a non-negative integer",
                    },
                    status=422,
                )
            patch: dict[str, Any] = {spec_path[-1]: replicas}
            for part in reversed(spec_path[:-1]):
                patch = {part: patch}
            async with self._lock:  # as kmock applies a patch, plus the version and generation the server bumps
                live = self._live(key)
                if live is not None and not live.deleted:
                    generation = int(live.get("metadata", {}).get("generation", 1)) + 1
                    patch["metadata"] = {"resourceVersion": str(next(self._versions)), "generation": generation}
                    live.patch(patch)
                    await self._buses[request.resource].put({"type": "MODIFIED", "object": live.raw})
        live = self._live(key)
        if live is None or live.deleted:
            return aiohttp.web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404},
                status=404,
            )
        obj = live.raw
        meta = obj["metadata"]
        return aiohttp.web.json_response({
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace"),
                         "resourceVersion": meta.get("resourceVersion")},
            "spec": {"replicas": _dig(obj, spec_path) if _dig(obj, spec_path) is not None
                     else SCALE_DEFAULT[request.resource.plural]},
            "status": {"replicas": _dig(obj, status_path) or 0, "selector": _dig(obj, selector_path) or ""},
        })  # fmt: skip


@contextlib.asynccontextmanager
async def emulated_cluster(
    request_log: int | None = None, installed: tuple[str, ...] = ()
) -> AsyncIterator[VersionedEmulator]:
    """An emulated API server on a localhost port with the built-in resources, our CRDs and the `installed` ones
    of OPTIONAL_CRDS."""
    async with VersionedEmulator(request_log=request_log) as emulator, kmock.Server(emulator):
        emulator.resources.load_bundled()
        for key, info in [*CRDS.items(), *(OPTIONAL_CRDS[name] for name in installed)]:
            emulator.resources[key] = info
        yield emulator


KUBECTL = Path(os.environ.get("GLM5_KUBECTL", Path(__file__).resolve().parents[2] / ".cache" / "tools" / "kubectl"))


def kubectl(server: str, *args: str, namespace: str = "default") -> str:
    """A real kubectl (scripts/get-helm) against the emulator; its stdout, or AssertionError with its stderr.
    Client-side validation is off: it needs the server's OpenAPI documents, which kmock does not serve."""
    assert KUBECTL.exists(), f"no kubectl binary at {KUBECTL}: run scripts/get-helm (scripts/bootstrap does)"
    extra = ["--validate=false"] if args and args[0] in ("apply", "create") else []
    argv = [str(KUBECTL), "--server", server, "--namespace", namespace, *args[:1], *extra, *args[1:]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout


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
