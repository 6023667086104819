"""GLM5Deployment: its children (workers as StatefulSets or LeaderWorkerSet groups, router, policies, the
autoscaler), pruning the autoscaler it no longer renders, and its status."""

from __future__ import annotations

import logging
import time
from typing import Any

from glm5_operator.api import GLM5DeploymentSpec, InvalidSpec, parse_deployment
from glm5_operator.kube import Outcome, Ref
from glm5_operator.reconcile.shared import DEPLOYMENT, Reconciling, WaitingFor, owner_of
from glm5_operator.render import autoscaling, deployment_children
from glm5_operator.render.common import selector
from glm5_operator.render.router import router_endpoints, router_name
from glm5_operator.render.workers import (
    LWS_API,
    worker_node_name,
)
from glm5_operator.status import (
    condition,
    deployment_conditions,
    invalid_spec_conditions,
    rollout,
)

log = logging.getLogger(__name__)


class DeploymentReconciler(Reconciling):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._keda: tuple[float, bool] | None = None  # (when asked, whether ScaledObjects are served)
        self._lws: tuple[float, bool] | None = None  # ... LeaderWorkerSets

    def refresh(self, body: dict[str, Any], recreate: bool) -> None:
        if recreate:
            self.reconcile(body, False)
        else:
            self.status(body, parse_deployment(body.get("spec") or {}))

    def reconcile(self, body: dict[str, Any], new: bool) -> dict[str, Outcome]:
        try:
            spec = parse_deployment(body.get("spec") or {})
        except InvalidSpec as exc:
            self._set_status(body, {}, invalid_spec_conditions(body["metadata"].get("generation"), str(exc)))
            raise
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            lws = self._uses_lws(body, spec)
        except InvalidSpec as exc:
            self._set_status(body, {}, invalid_spec_conditions(body["metadata"].get("generation"), str(exc)))
            raise
        if lws and not self._serves("lws"):
            message = ("spec.workers.multiNode: leaderWorkerSet, but the cluster serves no LeaderWorkerSets "
                       f"({LWS_API}): install LWS, or use statefulSets")  # fmt: skip
            gen = body["metadata"].get("generation")
            self._set_status(body, {}, [condition("Ready", False, "LeaderWorkerSetNotServed", message, gen)])
            raise WaitingFor(message)
        scaler = self._autoscaler_kind(spec)
        children = deployment_children(name, ns, spec, self.config, scaler == "ScaledObject", lws)
        outcomes = self._apply(body, children, new)
        self._prune_autoscaler(body, scaler)
        self.status(body, spec)
        return outcomes

    def _autoscaler_kind(self, spec: GLM5DeploymentSpec) -> str | None:
        a = spec.autoscaling
        if a is None:
            return None
        keda = a.backend == "keda" or (a.backend == "auto" and self._serves("keda"))
        return "ScaledObject" if keda else "HorizontalPodAutoscaler"

    def _serves(self, api: str, fresh: bool = False) -> bool:
        """Whether the cluster serves KEDA's ScaledObjects ("keda") or LeaderWorkerSets ("lws"), asked again after
        the config's api_recheck_s (a CRD installed later is found) or when `fresh`."""
        now = time.monotonic()
        known = self._keda if api == "keda" else self._lws
        if fresh or known is None or now - known[0] > self.config.api_recheck_s:
            found = self.kube.serves(*((autoscaling.KEDA_API, "scaledobjects") if api == "keda" else
                                       (LWS_API, "leaderworkersets")))  # fmt: skip
            known = (now, found)
            if api == "keda":
                self._keda = known
            else:
                self._lws = known
        return known[1]

    def _uses_lws(self, body: dict[str, Any], spec: GLM5DeploymentSpec) -> bool:
        """Whether multi-pod replicas run as LeaderWorkerSet groups. Decided once: the status records it (workers
        of the other kind would be left running beside the new ones: the operator deletes no workloads)."""
        w = spec.workers
        if w.pods_per_replica == 1:
            return False
        kind, ns, name = body["kind"], body["metadata"]["namespace"], body["metadata"]["name"]
        recorded = (self._written.get((kind, ns, name)) or body.get("status") or {}).get("workerSet")
        if recorded is None and self.kube.get(Ref("apps/v1", "StatefulSet", ns, worker_node_name(name, 1))):
            recorded = "StatefulSet"  # made before the status recorded it
        if w.multi_node == "auto":
            # decided once and for good: asked afresh, not from a cache that may predate an LWS install
            return recorded == "LeaderWorkerSet" if recorded else self._serves("lws", fresh=True)
        want = w.multi_node == "leaderWorkerSet"
        if recorded and (recorded == "LeaderWorkerSet") != want:
            raise InvalidSpec([
                f"spec.workers.multiNode: {w.multi_node}, but the workers run as {recorded}s, which cannot change "
                "in place; create a new GLM5Deployment (or delete this one's worker workloads first)"
            ])  # fmt: skip
        return want

    def _prune_autoscaler(self, body: dict[str, Any], rendered: str | None) -> None:
        """Delete the autoscaler the status names when this render has none of its kind (spec.autoscaling removed,
        or its backend changed): left behind it would keep writing workers.replicas. The only children the operator
        deletes."""
        kind, ns, name = body["kind"], body["metadata"]["namespace"], body["metadata"]["name"]
        status = self._written.get((kind, ns, name)) or body.get("status") or {}
        had = str(status.get("autoscaler") or "").partition("/")[0]
        api_version = dict(autoscaling.KINDS).get(had)
        if api_version is None or had == rendered:
            return
        ref = Ref(api_version, had, ns, autoscaling.autoscaler_name(name))
        live = self.kube.get(ref)
        if live is not None and owner_of(live) == (DEPLOYMENT, name):
            self.kube.delete(ref)
            log.info("deleted %s %s/%s (no longer in spec.autoscaling)", had, ns, ref.name)

    def status(self, body: dict[str, Any], spec: GLM5DeploymentSpec) -> None:
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        lws = self._uses_lws(body, spec)
        workers = self._workers_rollout(name, ns, spec, lws)
        router = rollout(
            self.kube.get(Ref("apps/v1", "Deployment", ns, router_name(name))),
            spec.router.replicas,
            "availableReplicas",
        )
        tables = self._sync_rank_tables(name, ns, spec, lws) if spec.workers.accelerator == "ascend-910b" else None
        conds = deployment_conditions(body["metadata"].get("generation"), workers, router, tables)
        scaler = self._autoscaler_kind(spec)
        fields: dict[str, Any] = {
            "replicas": spec.workers.replicas,
            "readyReplicas": workers.ready,
            "ready": f"{workers.ready}/{spec.workers.replicas}",
            "selector": ",".join(f"{k}={v}" for k, v in selector(name, "worker").items()),
            "endpoints": router_endpoints(name, ns, spec),
            # what scales workers.replicas (the reconcile deletes it once no longer rendered)
            "autoscaler": f"{scaler}/{autoscaling.autoscaler_name(name)}" if scaler else None,
            # how a replica over several pods runs (fixed once recorded)
            "workerSet": ("LeaderWorkerSet" if lws else "StatefulSet") if spec.workers.pods_per_replica > 1 else None,
        }
        if tables is not None:
            fields["rankTables"] = {str(r): s for r, s in sorted(tables.statuses.items())}
        self._set_status(body, fields, conds)
