"""Reconciliation: parse the spec, apply every child (adopted, create-or-patch), derive status from the
children's live state, keep the HCCL rank tables in step with the worker pods' device annotations.

Blocking (kubernetes client); kopf runs it in its sync-handler thread pool (see handlers.py). Calls for
the same custom resource are serialised with a lock so a child event and a spec update cannot interleave.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from glm5_operator.api import API_VERSION, GLM5DeploymentSpec, InvalidSpec, RLJobSpec, parse_deployment, parse_rljob
from glm5_operator.api.rljob import TRAINER_STATUS_PORT
from glm5_operator.config import OperatorConfig
from glm5_operator.kube import Kube, Outcome, Ref
from glm5_operator.ranktable import ANNOTATION, PodDevices, RankTableError, build_rank_table, parse_annotation
from glm5_operator.render import Child, autoscaling, deployment_children, rljob_children
from glm5_operator.render import rljob as rl
from glm5_operator.render.common import child_name, selector
from glm5_operator.render.router import router_endpoints, router_name
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
    worker_node_name,
)
from glm5_operator.status import (
    Condition,
    RankTables,
    Rollout,
    condition,
    deployment_conditions,
    invalid_spec_conditions,
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


class Reconciler:
    def __init__(self, kube: Kube, config: OperatorConfig, adopt: Adopt) -> None:
        self.kube = kube
        self.config = config
        self.adopt = adopt
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}
        # The status this process last wrote per resource (it is the only writer): kopf's event bodies can
        # predate a write made by a child event, so they are not a safe base for "did anything change".
        self._written: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._locks_guard = threading.Lock()
        self._keda: tuple[float, bool] | None = None  # (when asked, whether ScaledObjects are served)
        self._lws: tuple[float, bool] | None = None  # ... LeaderWorkerSets

    def _lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((kind, namespace, name), threading.Lock())

    # -- entry points ---------------------------------------------------------------------------------

    def reconcile(self, body: dict[str, Any], new: bool = False) -> dict[str, Outcome]:
        """Apply every child of a GLM5Deployment or RLJob; raises InvalidSpec (after setting the status) or
        WaitingFor. `new`: the resource was just created, so its children most likely do not exist yet.
        Returns what happened to each child, keyed `Kind/name`."""
        kind, ns, name = body["kind"], body["metadata"]["namespace"], body["metadata"]["name"]
        with self._lock(kind, ns, name):
            if kind == DEPLOYMENT:
                return self._reconcile_deployment(body, new)
            return self._reconcile_rljob(body, new)

    def refresh(self, kind: str, namespace: str, name: str, recreate: bool = False) -> None:
        """Re-derive a resource's status from its children (and re-apply them when `recreate`): the
        reaction to a child's event."""
        with self._lock(kind, namespace, name):
            body = self.kube.get(_ref(kind, namespace, name))
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            body.setdefault("kind", kind)
            try:
                if recreate:
                    self._reconcile_deployment(body, False) if kind == DEPLOYMENT else self._reconcile_rljob(
                        body, False
                    )
                elif kind == DEPLOYMENT:
                    self._deployment_status(body, parse_deployment(body.get("spec") or {}))
                else:
                    spec = parse_rljob(body.get("spec") or {})
                    succeeded = self._rljob_succeeded(body, spec)
                    if succeeded != self._recorded_success(body, spec):
                        self._reconcile_rljob(body, False)  # just finished: scale the job's workloads to zero
                    else:
                        self._rljob_status(body, spec, self._referenced(body, spec, required=False), succeeded)
            except (InvalidSpec, WaitingFor):
                return  # the resource's own handler reports these

    # -- GLM5Deployment -------------------------------------------------------------------------------

    def _reconcile_deployment(self, body: dict[str, Any], new: bool) -> dict[str, Outcome]:
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
        self._deployment_status(body, spec)
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

    def _deployment_status(self, body: dict[str, Any], spec: GLM5DeploymentSpec) -> None:
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

    # -- RLJob ----------------------------------------------------------------------------------------

    def _referenced(self, body: dict[str, Any], spec: RLJobSpec, required: bool) -> GLM5DeploymentSpec | None:
        ref_name = spec.rollout.deployment_ref
        if ref_name is None:
            return None
        ns = body["metadata"]["namespace"]
        target = self.kube.get(_ref(DEPLOYMENT, ns, ref_name))
        if target is None:
            message = f"rollout.deploymentRef: GLM5Deployment {ns}/{ref_name} does not exist"
            if required:
                gen = body["metadata"].get("generation")
                self._set_status(body, {"phase": "Pending"}, [
                    condition("RolloutReady", False, "DeploymentNotFound", message, gen),
                    condition("Ready", False, "DeploymentNotFound", message, gen),
                ])  # fmt: skip
            raise WaitingFor(message)
        try:
            return parse_deployment(target.get("spec") or {})
        except InvalidSpec as exc:
            raise WaitingFor(f"rollout.deploymentRef: GLM5Deployment {ns}/{ref_name} is invalid: {exc}") from exc

    def _reconcile_rljob(self, body: dict[str, Any], new: bool) -> dict[str, Outcome]:
        gen = body["metadata"].get("generation")
        try:
            spec = parse_rljob(body.get("spec") or {})
        except InvalidSpec as exc:
            self._set_status(body, {"phase": "Failed"}, invalid_spec_conditions(gen, str(exc)))
            raise
        ref_spec = self._referenced(body, spec, required=True)
        if ref_spec is not None and ref_spec.security.tls_secret:
            # the gateway and trainer present no client certificates yet: they could not reach the workers
            message = (
                f"rollout.deploymentRef: GLM5Deployment {spec.rollout.deployment_ref} uses mutual TLS "
                "(security.tlsSecret), which RLJob pods do not speak yet; give the job its own workers"
            )
            self._set_status(body, {"phase": "Pending"}, [
                condition("RolloutReady", False, "TLSNotSupported", message, gen),
                condition("Ready", False, "TLSNotSupported", message, gen),
            ])  # fmt: skip
            raise WaitingFor(message)
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        trainer = self.kube.get(Ref("apps/v1", "StatefulSet", ns, child_name(name, "trainer")))
        if trainer is not None and bool(trainer["spec"].get("volumeClaimTemplates")) != (spec.trainer.nodes == 1):
            problem = InvalidSpec([
                f"spec.trainer.nodes: {spec.trainer.nodes} moves the trainer between its own checkpoint claim (1 "
                "pod) and one shared by its pods (more than 1), which cannot change once the job runs; create a new "
                "RLJob (its policy can be this job's last version)"
            ])  # fmt: skip
            self._set_status(body, {"phase": "Failed"}, invalid_spec_conditions(gen, str(problem)))
            raise problem
        succeeded = self._rljob_succeeded(body, spec)
        outcomes = self._apply(body, rljob_children(name, ns, spec, self.config, ref_spec, succeeded), new)
        self._rljob_status(body, spec, ref_spec, succeeded)
        return outcomes

    def _recorded_success(self, body: dict[str, Any], spec: RLJobSpec) -> bool:
        """The status already says the job took its current `steps` (sticky once the trainer pod is gone)."""
        key = (body["kind"], body["metadata"]["namespace"], body["metadata"]["name"])
        status = self._written.get(key) or body.get("status") or {}
        return bool(spec.trainer.steps) and status.get("completedSteps") == spec.trainer.steps

    def _rljob_succeeded(self, body: dict[str, Any], spec: RLJobSpec) -> bool:
        """The trainer took the job's `steps`: recorded in the status, or reported in the trainer container's
        termination message (exit 0 with `{"complete": true, "steps": N, "version": V}`; a SIGTERM'd trainer also
        exits 0 but reports nothing)."""
        if not spec.trainer.steps:
            return False
        if self._recorded_success(body, spec):
            return True
        report = self._trainer_report(body)
        return report is not None and report.get("steps") == spec.trainer.steps

    def _trainer_pod(self, body: dict[str, Any]) -> dict[str, Any]:
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        return self.kube.get(Ref("v1", "Pod", ns, f"{child_name(name, 'trainer')}-0")) or {}

    def _trainer_progress(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Status fields from the running trainer's GET /status (None when it cannot be asked or does not answer:
        the fields keep their last values)."""
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        pod = self._trainer_pod(body)
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or (pod.get("status") or {}).get("phase") != "Running":
            return None
        try:
            with urllib.request.urlopen(f"http://{ip}:{TRAINER_STATUS_PORT}/status", timeout=2) as reply:
                got = json.loads(reply.read(64 << 10))
        except (OSError, ValueError) as exc:
            log.debug("RLJob %s/%s: no progress from the trainer at %s: %s", ns, name, ip, exc)
            return None
        if not isinstance(got, dict):
            return None
        out: dict[str, Any] = {}
        for key, field in (("steps", "trainedSteps"), ("policyVersion", "policyVersion"),
                           ("trainerWorldSize", "trainerWorldSize")):  # fmt: skip
            if isinstance(got.get(key), int) and not isinstance(got.get(key), bool):
                out[field] = got[key]
        if isinstance(got.get("lastSyncTime"), str) and len(got["lastSyncTime"]) <= 40:
            out["lastSyncTime"] = got["lastSyncTime"]
        if isinstance(got.get("phase"), str) and got["phase"].isalpha() and len(got["phase"]) <= 20:
            out["trainerPhase"] = got["phase"]
        return out

    def _trainer_report(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The completion the trainer container wrote to its termination log, if it exited 0 with one."""
        pod = self._trainer_pod(body)
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            for state in (cs.get("state") or {}, cs.get("lastState") or {}):
                done = state.get("terminated") or {}
                if done.get("exitCode") != 0:
                    continue
                try:
                    message = json.loads(done.get("message") or "")
                except ValueError:
                    continue
                if isinstance(message, dict) and message.get("complete"):
                    return message
        return None

    def _rljob_status(
        self, body: dict[str, Any], spec: RLJobSpec, ref_spec: GLM5DeploymentSpec | None, succeeded: bool
    ) -> None:
        ns, name, gen = body["metadata"]["namespace"], body["metadata"]["name"], body["metadata"].get("generation")
        eps_low, eps_high = spec.trainer.trust_region()
        region = {"epsLow": eps_low, "epsHigh": eps_high}
        if succeeded:
            steps = spec.trainer.steps
            status = self._written.get((body["kind"], ns, name)) or body.get("status") or {}
            version = status.get("policyVersion") if self._recorded_success(body, spec) else None
            if version is None:
                version = (self._trainer_report(body) or {}).get("version")
            checkpoint = {"claim": rl.checkpoint_claim(name, spec.trainer.nodes)}
            if isinstance(version, int):
                checkpoint["path"] = rl.synced_path(version)
            where = f"{checkpoint.get('path', 'actor_synced/')} on claim {checkpoint['claim']}"
            conds = [
                condition("Succeeded", True, "StepsCompleted",
                          f"the trainer took the job's {steps} steps; the final version is {where}", gen),
                condition("Ready", False, "Succeeded", "the job has finished: its workloads are scaled to zero", gen),
            ]  # fmt: skip
            fields = {"phase": "Succeeded", "completedSteps": steps, "trainedSteps": steps, "trustRegion": region,
                      "checkpoint": checkpoint, "policyVersion": version if isinstance(version, int) else None,
                      "trainerPhase": "done"}  # fmt: skip
            self._set_status(body, fields, conds)
            return
        gateway = rollout(self.kube.get(Ref("apps/v1", "Deployment", ns, child_name(name, "gateway"))),
                          spec.gateway.replicas, "availableReplicas")  # fmt: skip
        trainer = rollout(
            self.kube.get(Ref("apps/v1", "StatefulSet", ns, child_name(name, "trainer"))),
            spec.trainer.nodes,
            "readyReplicas",
        )
        if ref_spec is not None:
            assert spec.rollout.deployment_ref is not None
            engines = self._workers_rollout(spec.rollout.deployment_ref, ns, ref_spec)
        else:
            own = rl.rollout_deployment_spec(spec)
            engines = self._workers_rollout(rl.rollout_instance(name), ns, own)
            if own.workers.accelerator == "ascend-910b":
                self._sync_rank_tables(rl.rollout_instance(name), ns, own)
        parts = (("GatewayReady", gateway, "gateway replicas"), ("TrainerReady", trainer, "trainer"),
                 ("RolloutReady", engines, "rollout engine replicas"))  # fmt: skip
        conds = [
            condition(t, r.complete, "Ready" if r.complete else "NotReady", r.describe(what), gen)
            for t, r, what in parts
        ]
        waiting = [c for c in conds if c["status"] == "False"]
        if waiting:
            reason = waiting[0]["type"].removesuffix("Ready") + "NotReady"
            conds.append(condition("Ready", False, reason, waiting[0]["message"], gen))
        else:
            conds.append(condition("Ready", True, "Ready", "gateway, trainer and rollout engines are ready", gen))
        if spec.trainer.steps:
            conds.append(condition("Succeeded", False, "Training", f"training towards {spec.trainer.steps} steps", gen))
        fields = {"phase": "Running" if not waiting else "Pending", "completedSteps": None, "trustRegion": region}
        progress = self._trainer_progress(body)
        if progress is not None:
            fields |= progress
        self._set_status(body, fields, conds)

    # -- shared ---------------------------------------------------------------------------------------

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
