"""RLJob: its gateway, trainer and (unless it uses a GLM5Deployment's) rollout workers; success from the trainer's
report, progress from its status endpoint, and the job's status."""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any

from glm5_operator.api import GLM5DeploymentSpec, InvalidSpec, RLJobSpec, parse_deployment, parse_rljob
from glm5_operator.api.rljob import TRAINER_STATUS_PORT
from glm5_operator.kube import Outcome, Ref
from glm5_operator.reconcile.shared import DEPLOYMENT, Reconciling, WaitingFor, _ref
from glm5_operator.render import rljob as rl
from glm5_operator.render import rljob_children
from glm5_operator.render.common import child_name
from glm5_operator.status import (
    condition,
    invalid_spec_conditions,
    rollout,
)

log = logging.getLogger(__name__)


class RLJobReconciler(Reconciling):
    def refresh(self, body: dict[str, Any], recreate: bool) -> None:
        if recreate:
            self.reconcile(body, False)
            return
        spec = parse_rljob(body.get("spec") or {})
        succeeded = self._rljob_succeeded(body, spec)
        if succeeded != self._recorded_success(body, spec):
            self.reconcile(body, False)  # just finished: scale the job's workloads to zero
        else:
            self.status(body, spec, self._referenced(body, spec, required=False), succeeded)

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

    def reconcile(self, body: dict[str, Any], new: bool) -> dict[str, Outcome]:
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
        self.status(body, spec, ref_spec, succeeded)
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

    def status(
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
