"""Semantic checks the CRD schema cannot express. Each problem is a message for the InvalidSpec condition.

Parsing (types, enums, ranges) is pydantic's: `parse_*` turns its errors into the same kind of messages,
so a bad spec always ends as Ready=False / InvalidSpec with every problem listed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from glm5_operator.api.deployment import GLM5DeploymentSpec, ModelSource, Workers
from glm5_operator.api.rljob import TRAINER_STATUS_PORT, RLJobSpec

T = TypeVar("T", bound=BaseModel)


class InvalidSpec(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _pydantic_problems(exc: ValidationError) -> list[str]:
    return [f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)]


def _model_problems(model: ModelSource, where: str) -> list[str]:
    out = []
    if model.pvc_name and model.host_path:
        out.append(f"{where}: give pvcName or hostPath, not both")
    rs = model.rope_scaling
    if rs is not None and not math.log2(rs.factor).is_integer():
        out.append(f"{where}.ropeScaling.factor: must be a power of two (2, 4, 8, ...), got {rs.factor:g}")
    return out


def _worker_problems(w: Workers, where: str) -> list[str]:
    out = []
    if w.ring_order is not None:
        if len(w.ring_order) != w.devices_per_replica:
            out.append(
                f"{where}.ringOrder: lists {len(w.ring_order)} ranks but devicesPerReplica is {w.devices_per_replica}"
            )
        elif sorted(w.ring_order) != list(range(w.devices_per_replica)):
            out.append(f"{where}.ringOrder: must be a permutation of 0..{w.devices_per_replica - 1}")
        if w.accelerator != "ascend-910b":
            out.append(f"{where}.ringOrder: only applies to accelerator ascend-910b (HCCL)")
    if w.devices_per_node is not None and w.devices_per_replica % w.devices_per_node:
        out.append(
            f"{where}.devicesPerNode: {w.devices_per_node} does not divide devicesPerReplica "
            f"({w.devices_per_replica}); a replica spans whole pods"
        )
    return out


def deployment_problems(spec: GLM5DeploymentSpec) -> list[str]:
    out = _model_problems(spec.model, "spec.model") + _worker_problems(spec.workers, "spec.workers")
    q = spec.router.queues
    if q.short_max_prompt_tokens > q.long_min_prompt_tokens:
        out.append("spec.router.queues: shortMaxPromptTokens must not exceed longMinPromptTokens")
    if spec.router.redis and spec.router.redis.url and spec.router.redis.url_secret:
        out.append("spec.router.redis: give url or urlSecret, not both")
    if spec.model.max_new_tokens >= spec.model.max_model_len:
        out.append("spec.model.maxNewTokens: must be below maxModelLen")
    sec = spec.security
    if sec.https and not sec.tls_secret:
        out.append("spec.security.https: needs tlsSecret (the certificate to serve)")
    if sec.require_sealed and not spec.router.sm4_key_secret:
        out.append("spec.security.requireSealed: needs spec.router.sm4KeySecret")
    if sec.health_port in (spec.workers.port, spec.workers.rendezvous_port, spec.router.grpc_port,
                           spec.router.http_port):  # fmt: skip
        out.append(f"spec.security.healthPort: {sec.health_port} is already another port of the deployment")
    auto = spec.autoscaling
    if auto is not None:
        if auto.min_replicas > auto.max_replicas:
            out.append(f"spec.autoscaling: minReplicas {auto.min_replicas} exceeds maxReplicas {auto.max_replicas}")
        if auto.metric == "kvCacheUtilization" and auto.target > 1:
            out.append(f"spec.autoscaling.target: kvCacheUtilization is a share of the KV blocks (0..1), got "
                       f"{auto.target:g}")  # fmt: skip
    return out


def rljob_problems(spec: RLJobSpec) -> list[str]:
    out = _model_problems(spec.policy, "spec.policy")
    pool = spec.rollout
    if (pool.deployment_ref is None) == (pool.workers is None):
        out.append("spec.rollout: give exactly one of deploymentRef or workers")
    if pool.workers is not None:
        out += _worker_problems(pool.workers, "spec.rollout.workers")
    t = spec.trainer
    if t.task_preset == "custom" and (t.eps_low is None or t.eps_high is None):
        out.append("spec.trainer: taskPreset custom needs epsLow and epsHigh")
    if t.nodes > 1 and t.master_port in (TRAINER_STATUS_PORT, t.sync_port):
        out.append(f"spec.trainer.masterPort: {t.master_port} is already the trainer's status or sync port")
    d = spec.dataset
    mount = d.mount_path.rstrip("/") + "/"
    if d.pvc_name and not d.uri.startswith(mount):
        out.append(f"spec.dataset.uri: with pvcName the file must be under mountPath {d.mount_path}, got {d.uri}")
    policy = spec.policy.path.rstrip("/") + "/"
    if d.pvc_name and (policy.startswith(mount) or mount.startswith(policy)):
        out.append(f"spec.dataset.mountPath: {d.mount_path} and spec.policy.path {spec.policy.path} must not nest")
    return out


def _parse(model: type[T], spec: dict[str, Any], problems: Callable[[T], list[str]]) -> T:
    try:
        parsed = model.model_validate(spec)
    except ValidationError as exc:
        raise InvalidSpec(_pydantic_problems(exc)) from exc
    found = problems(parsed)
    if found:
        raise InvalidSpec(found)
    return parsed


def parse_deployment(spec: dict[str, Any]) -> GLM5DeploymentSpec:
    """The validated spec, or InvalidSpec listing every problem."""
    return _parse(GLM5DeploymentSpec, spec, deployment_problems)


def parse_rljob(spec: dict[str, Any]) -> RLJobSpec:
    """The validated spec, or InvalidSpec listing every problem."""
    return _parse(RLJobSpec, spec, rljob_problems)
