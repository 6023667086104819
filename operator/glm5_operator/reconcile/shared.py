"""What reconciling either custom resource needs: applying children (owner labels, adoption, create-or-patch),
writing the status subresource only when it changed, and the worker workloads' rollout and HCCL rank tables (an
RLJob with its own rollout workers has them too)."""

from __future__ import annotations

import copy
import datetime
import json
import logging
from collections.abc import Callable
from typing import Any

from glm5_operator.api import API_VERSION, GLM5DeploymentSpec
from glm5_operator.config import OperatorConfig
from glm5_operator.kube import Kube, Outcome, Ref
from glm5_operator.ranktable import ANNOTATION, PodDevices, RankTableError, build_rank_table, parse_annotation
from glm5_operator.render import Child
from glm5_operator.render.common import selector
from glm5_operator.render.workers import (
    LWS_API,
    LWS_GROUP_LABEL,
    LWS_WORKER_LABEL,
    NODE_RANK_LABEL,
    POD_INDEX_LABEL,
    lws_name,
    rank_table_key,
    rank_table_name,
    worker_components,
    worker_name,
)
from glm5_operator.status import (
    Condition,
    RankTables,
    Rollout,
    is_ready,
    merge_conditions,
    rollout,
)

log = logging.getLogger(__name__)

OWNER_KIND = "glm5.ai/owner-kind"
OWNER_NAME = "glm5.ai/owner-name"
DEPLOYMENT, RLJOB = "GLM5Deployment", "RLJob"
# kopf.adopt(manifest, owner) in production; tests may pass the same function.
Adopt = Callable[[dict[str, Any], dict[str, Any]], None]


class WaitingFor(Exception):
    """Something the reconcile needs does not exist yet; retry later (kopf.TemporaryError)."""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ref(kind: str, namespace: str, name: str) -> Ref:
    return Ref(API_VERSION, kind, namespace, name)


def owner_of(obj: dict[str, Any]) -> tuple[str, str] | None:
    labels = obj.get("metadata", {}).get("labels") or {}
    kind, name = labels.get(OWNER_KIND), labels.get(OWNER_NAME)
    return (kind, name) if kind in (DEPLOYMENT, RLJOB) and name else None


class Reconciling:
    """State both kinds share: `written` is the status this process last wrote per resource (it is the only
    writer): kopf's event bodies can predate a write made by a child event, so they are not a safe base for "did
    anything change"."""

    def __init__(
        self, kube: Kube, config: OperatorConfig, adopt: Adopt, written: dict[tuple[str, str, str], dict[str, Any]]
    ) -> None:
        self.kube, self.config, self.adopt, self._written = kube, config, adopt, written

    def _workers_rollout(self, instance: str, ns: str, spec: GLM5DeploymentSpec, lws: bool = False) -> Rollout:
        """Ready replicas: the first node's StatefulSet, or the LeaderWorkerSet's ready groups."""
        if lws:
            return rollout(self.kube.get(Ref(LWS_API, "LeaderWorkerSet", ns, lws_name(instance))),
                           spec.workers.replicas, "readyReplicas")  # fmt: skip
        sts = self.kube.get(Ref("apps/v1", "StatefulSet", ns, worker_name(instance)))
        return rollout(sts, spec.workers.replicas, "readyReplicas")

    def _sync_rank_tables(self, instance: str, ns: str, spec: GLM5DeploymentSpec, lws: bool = False) -> RankTables:
        """Build each replica's hccl.json from its pods' device annotations (one pod per node of the replica,
        in node order) and write the changed ones."""
        w = spec.workers
        nodes = w.pods_per_replica
        by_slot: dict[tuple[int, int], dict[str, Any]] = {}
        for component in worker_components(w, lws):
            for pod in self.kube.list(Ref("v1", "Pod", ns), labels=selector(instance, component)):
                where = _pod_slot(pod)
                if where is not None and where[1] < nodes and not pod["metadata"].get("deletionTimestamp"):
                    by_slot[where] = pod
        tables: dict[int, dict[str, Any]] = {}
        error: str | None = None
        for replica in range(w.replicas):
            devices: list[PodDevices | None] = []
            for node in range(nodes):
                slot = by_slot.get((replica, node))
                found = None
                if slot is not None:
                    meta = slot["metadata"]
                    raw = (meta.get("annotations") or {}).get(ANNOTATION)
                    try:
                        ip = (slot.get("status") or {}).get("podIP")
                        found = parse_annotation(meta["name"], ip, raw, w.node_devices)
                    except RankTableError as exc:
                        error = error or str(exc)
                devices.append(found)
            try:
                tables[replica] = build_rank_table(devices, w.ring_order)
            except RankTableError as exc:
                error = error or str(exc)
                tables[replica] = build_rank_table([None] * nodes, None)
        self._write_rank_tables(instance, ns, w.replicas, tables)
        return RankTables({r: str(t["status"]) for r, t in tables.items()}, error)

    def _write_rank_tables(self, instance: str, ns: str, replicas: int, tables: dict[int, dict[str, Any]]) -> None:
        ref = Ref("v1", "ConfigMap", ns, rank_table_name(instance))
        live = self.kube.get(ref)
        if live is None:
            return  # the reconcile creates it (adopted); the next pod event fills it in
        have: dict[str, str] = live.get("data") or {}
        want = {rank_table_key(r): json.dumps(t, indent=2) + "\n" for r, t in tables.items()}
        patch: dict[str, str | None] = {k: v for k, v in want.items() if have.get(k) != v}
        patch.update({k: None for k in have if k not in want and k.startswith("replica-")})  # scaled down
        if patch:
            self.kube.patch(ref, {"data": patch})
            log.info(
                "rank tables of %s/%s: %s",
                ns,
                instance,
                {k: json.loads(v)["status"] if v else None for k, v in patch.items()},
            )

    def _apply(self, owner: dict[str, Any], children: list[Child], new: bool) -> dict[str, Outcome]:
        owner_labels = {OWNER_KIND: owner["kind"], OWNER_NAME: owner["metadata"]["name"]}
        outcomes: dict[str, Outcome] = {}
        for child in children:
            manifest = copy.deepcopy(child.manifest)
            manifest["metadata"]["labels"].update(owner_labels)
            spec = manifest.get("spec", {})
            group = spec.get("leaderWorkerTemplate") or {}
            for template in (spec.get("template"), group.get("leaderTemplate"), group.get("workerTemplate")):
                if template is not None:  # pods map back to their owner (rank tables, status)
                    template["metadata"]["labels"].update(owner_labels)
            if child.owned:
                self.adopt(manifest, owner)
            outcomes[f"{child.kind}/{child.name}"] = self.kube.apply(manifest, child.create_only, new)
        return outcomes

    def _set_status(self, body: dict[str, Any], fields: dict[str, Any], conds: list[Condition]) -> None:
        """Patch the status subresource when something in it changed (a no-op write would wake watchers)."""
        kind, ns, name = body["kind"], body["metadata"]["namespace"], body["metadata"]["name"]
        ref = _ref(kind, ns, name)
        old = self._written.get((kind, ns, name)) or body.get("status") or {}
        merged = merge_conditions(old.get("conditions"), conds, _now())
        gen = body["metadata"].get("generation")
        new = {**fields, "conditions": merged}
        if gen is not None and any(c["type"] == "Ready" and c.get("reason") != "InvalidSpec" for c in conds):
            new["observedGeneration"] = gen
        if all(old.get(k) == v for k, v in new.items()):
            return
        self.kube.patch(ref, {"status": new}, subresource="status")
        self._written[(kind, ns, name)] = {**old, **new}
        if is_ready(merged) != is_ready(old.get("conditions") or []):
            log.info("%s %s/%s ready=%s", kind, ns, name, is_ready(merged))


def _pod_slot(pod: dict[str, Any]) -> tuple[int, int] | None:
    """(replica, node of the replica) of a worker pod: a LeaderWorkerSet's group and worker index, or the
    StatefulSet ordinal (the pod-index label, Kubernetes >= 1.28, else the name's suffix) and the node-rank label."""
    meta = pod["metadata"]
    have = meta.get("labels") or {}
    if LWS_GROUP_LABEL in have:
        replica, node = have[LWS_GROUP_LABEL], have.get(LWS_WORKER_LABEL, "")
    else:
        replica, node = have.get(POD_INDEX_LABEL) or meta["name"].rsplit("-", 1)[-1], have.get(NODE_RANK_LABEL, "0")
    return (int(replica), int(node)) if replica.isdigit() and node.isdigit() else None
