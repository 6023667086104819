"""A small typed layer over the kubernetes client's REST calls: get, create, merge-patch, list, and the
create-or-patch `apply` every reconcile goes through.

`apply` is idempotent: a child is created when missing, patched only when the rendered fields differ from
the live object (so replays and restarts write nothing), and fields the previous render set but this one does
not are removed, found through the last applied manifest kept in an annotation (as `kubectl apply` does).
Blocking: call it from kopf's sync handlers, which run in a thread pool.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

import kubernetes

log = logging.getLogger(__name__)

LAST_APPLIED = "glm5.ai/last-applied"
# kind -> plural; group/version come from the manifest's apiVersion.
PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "Pod": "pods",
    "Secret": "secrets",
    "Event": "events",
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",
    "LeaderWorkerSet": "leaderworkersets",
    "GLM5Deployment": "glm5deployments",
    "RLJob": "rljobs",
}

Outcome = Literal["created", "patched", "unchanged"]


class KubeError(RuntimeError):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Ref:
    api_version: str
    kind: str
    namespace: str
    name: str | None = None

    def path(self, subresource: str | None = None) -> str:
        base = "/api" if "/" not in self.api_version else "/apis"
        path = f"{base}/{self.api_version}/namespaces/{self.namespace}/{PLURALS[self.kind]}"
        if self.name is not None:
            path += f"/{self.name}"
        if subresource:
            path += f"/{subresource}"
        return path

    @classmethod
    def of(cls, manifest: dict[str, Any]) -> Ref:
        meta = manifest["metadata"]
        return cls(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])


class Kube:
    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.api = api

    @classmethod
    def from_environment(cls) -> Kube:
        """In a pod: its service account; elsewhere: the current kubeconfig context."""
        try:
            kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
        return cls(kubernetes.client.ApiClient())

    @staticmethod
    def credentials_problem() -> str | None:
        """Why there are no cluster credentials here (None when there are): kopf would otherwise retry its
        login with a traceback every minute, forever."""
        try:
            kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
            return None
        except kubernetes.config.ConfigException:
            pass
        try:
            kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
            return None
        except (kubernetes.config.ConfigException, OSError) as exc:
            return f"no Kubernetes credentials: not in a pod, and no usable kubeconfig ({exc})"

    @classmethod
    def for_server(cls, server: str) -> Kube:
        configuration = kubernetes.client.Configuration(host=server)
        return cls(kubernetes.client.ApiClient(configuration))

    def _call(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        _, url, headers, body, _ = self.api.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
        response.read()  # type: ignore[no-untyped-call]
        data = json.loads(response.data) if response.data else None
        if not 200 <= response.status < 300:
            reason = data.get("reason", "") if isinstance(data, dict) else ""
            message = data.get("message", "") if isinstance(data, dict) else str(response.data)
            raise KubeError(response.status, reason, message)
        return data

    def get(self, ref: Ref, subresource: str | None = None) -> dict[str, Any] | None:
        try:
            return dict(self._call("GET", ref.path(subresource)))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, ref: Ref, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        query = ""
        if labels:
            query = "?labelSelector=" + ",".join(f"{k}%3D{v}" for k, v in sorted(labels.items()))
        items = self._call("GET", ref.path() + query).get("items", [])
        # Filter here too: the selector is a hint some API emulators ignore.
        return [i for i in items if _matches(i, labels or {})]

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        ref = Ref.of(manifest)
        return dict(self._call("POST", Ref(ref.api_version, ref.kind, ref.namespace).path(), manifest))

    def patch(self, ref: Ref, body: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        return dict(self._call("PATCH", ref.path(subresource), body, "application/merge-patch+json"))

    def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in `api_version` (a CRD such as KEDA's is installed)."""
        try:
            found = self._call("GET", f"/apis/{api_version}")
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in (found or {}).get("resources") or [])

    def delete(self, ref: Ref) -> None:
        try:
            self._call("DELETE", ref.path())
        except KubeError as exc:
            if exc.status != 404:
                raise

    def apply(self, manifest: dict[str, Any], create_only: bool = False, likely_new: bool = False) -> Outcome:
        """Create or patch so that the live object carries `manifest`'s fields; see the module docstring.
        `likely_new` (the owner was just created) tries the create first and reads only on a conflict."""
        ref = Ref.of(manifest)
        desired = _with_last_applied(manifest)
        live = None if likely_new else self.get(ref)
        if live is None:
            try:
                self.create(desired)
                log.info("created %s %s/%s", ref.kind, ref.namespace, ref.name)
                return "created"
            except KubeError as exc:
                if exc.status != 409:
                    raise
                live = self.get(ref)  # created concurrently (a replayed event): fall through to compare
                if live is None:
                    raise
        if create_only:
            return "unchanged"
        previous = _last_applied(live)
        removed = _removed(previous, _applied_fields(manifest)) if previous is not None else {}
        if is_subset(_comparable(desired), live) and not removed:
            return "unchanged"
        self.patch(ref, _merge(_comparable(desired), removed))
        log.info("patched %s %s/%s", ref.kind, ref.namespace, ref.name)
        return "patched"


def _matches(obj: dict[str, Any], labels: dict[str, str]) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def _applied_fields(manifest: dict[str, Any]) -> dict[str, Any]:
    """What apply owns: labels, annotations (but the bookkeeping one), owner references, spec/data."""
    meta = manifest.get("metadata", {})
    out: dict[str, Any] = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    owned_meta = {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
    if "annotations" in owned_meta:
        owned_meta["annotations"] = {k: v for k, v in owned_meta["annotations"].items() if k != LAST_APPLIED}
    out["metadata"] = owned_meta
    return out


def _with_last_applied(manifest: dict[str, Any]) -> dict[str, Any]:
    if manifest["kind"] == "Secret":
        return manifest  # created once, never patched: no copy of its data in an annotation
    applied = json.dumps(_applied_fields(manifest), sort_keys=True, separators=(",", ":"))
    meta = dict(manifest["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), LAST_APPLIED: applied}
    return {**manifest, "metadata": meta}


def _last_applied(live: dict[str, Any]) -> dict[str, Any] | None:
    raw = (live.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        return dict(json.loads(raw)) if raw else None
    except (ValueError, TypeError):
        return None


def _comparable(desired: dict[str, Any]) -> dict[str, Any]:
    fields = _applied_fields(desired)
    fields["metadata"] = {**fields["metadata"], "annotations": desired["metadata"]["annotations"]}
    return fields


def _removed(previous: Any, current: Any) -> dict[str, Any]:
    """A merge patch that deletes (null) the keys `previous` had and `current` no longer has."""
    out: dict[str, Any] = {}
    if not isinstance(previous, dict) or not isinstance(current, dict):
        return out
    for key, old in previous.items():
        if key not in current:
            out[key] = None
        elif isinstance(old, dict) and isinstance(current[key], dict):
            nested = _removed(old, current[key])
            if nested:
                out[key] = nested
    return out


def _merge(body: dict[str, Any], removals: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    for key, value in removals.items():
        if value is None:
            out[key] = None
        elif isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def is_subset(desired: Any, live: Any) -> bool:
    """Whether every rendered field has its value in the live object; fields the server defaults are ignored
    (inside lists too, element by element). Quantities compare as strings (the API server returns 1 as "1")."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    if desired == live:
        return True
    scalar = (int, float, str)
    return (
        isinstance(desired, scalar)
        and isinstance(live, scalar)
        and not isinstance(desired, bool)
        and str(desired) == str(live)
    )
