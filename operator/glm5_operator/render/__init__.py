"""Pure functions from a custom resource's spec to its children's manifests (no cluster needed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glm5_operator.api.deployment import GLM5DeploymentSpec
from glm5_operator.api.rljob import RLJobSpec
from glm5_operator.config import OperatorConfig
from glm5_operator.ranktable import build_rank_table
from glm5_operator.render import autoscaling, network, router, workers
from glm5_operator.render import rljob as rl


@dataclass(frozen=True, slots=True)
class Child:
    manifest: dict[str, Any]
    # Created when missing but never patched by the spec reconcile: its data has another writer
    # (the rank-table ConfigMap is filled in from the pods' device annotations).
    create_only: bool = False
    owned: bool = True  # deleted with its owner (ownerReferences); False: kept, like a StatefulSet's claims

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


def worker_children(
    instance: str, namespace: str, spec: GLM5DeploymentSpec, config: OperatorConfig, lws: bool = False
) -> list[Child]:
    """`lws`: a replica over several pods is a LeaderWorkerSet group (else one StatefulSet per node)."""
    out = [
        Child(network.admin_secret(instance, namespace), create_only=True),
        Child(network.internal_secret(instance, namespace), create_only=True),
        Child(workers.engine_config_map(instance, namespace, spec)),
    ]
    w = spec.workers
    if w.accelerator == "ascend-910b":
        pending = build_rank_table([None] * w.pods_per_replica, w.ring_order)
        tables = dict.fromkeys(range(w.replicas), pending)
        out.append(Child(workers.rank_table_config_map(instance, namespace, tables), create_only=True))
    out.append(Child(workers.worker_service(instance, namespace, spec)))
    lws = lws and w.pods_per_replica > 1
    if lws:  # its controller creates the group's headless Service (the leaders' names)
        out.append(Child(workers.worker_leader_worker_set(instance, namespace, spec, config)))
    else:
        if w.pods_per_replica > 1:
            out.append(Child(workers.ranks_service(instance, namespace, spec)))
        out += [Child(m) for m in workers.worker_stateful_sets(instance, namespace, spec, config)]
    out.append(Child(workers.worker_pdb(instance, namespace)))
    if spec.security.network_policy:
        components = workers.worker_components(w, lws)
        out.append(Child(network.worker_network_policy(instance, namespace, spec, components)))
    return out


def deployment_children(
    name: str, namespace: str, spec: GLM5DeploymentSpec, config: OperatorConfig, keda: bool = False,
    lws: bool = False,
) -> list[Child]:  # fmt: skip
    """Every child of a GLM5Deployment, in apply order (configuration before what mounts it); `keda`: the cluster
    serves KEDA's ScaledObject (spec.autoscaling's backend auto picks it); `lws`: multi-pod replicas are
    LeaderWorkerSet groups."""
    scaler = autoscaling.autoscaler(name, namespace, spec, keda, config.prometheus_url)
    return [
        *worker_children(name, namespace, spec, config, lws),
        Child(router.router_config_map(name, namespace, spec)),
        Child(router.router_deployment(name, namespace, spec, config)),
        Child(router.router_service(name, namespace, spec)),
        *([Child(network.router_network_policy(name, namespace, spec))] if spec.security.network_policy else []),
        *([Child(scaler)] if scaler is not None else []),
    ]


def rljob_children(
    name: str,
    namespace: str,
    spec: RLJobSpec,
    config: OperatorConfig,
    ref_spec: GLM5DeploymentSpec | None,
    succeeded: bool = False,
) -> list[Child]:
    """Every child of an RLJob; `ref_spec` is the referenced GLM5Deployment's spec when it has a deploymentRef.
    A job that has `succeeded` keeps its children (the checkpoint volume, the settings) at zero replicas."""
    engines, _ = rl.engines_address(name, namespace, spec, ref_spec)
    # the gateway and trainer call the workers: their NetworkPolicy lets pods labelled as clients in
    client_of = spec.rollout.deployment_ref or rl.rollout_instance(name)
    settings = rl.rl_settings(name, namespace, spec, engines)
    gateway = rl.gateway_settings(spec, engines)
    out: list[Child] = []
    if spec.rollout.deployment_ref is None:
        out += worker_children(rl.rollout_instance(name), namespace, rl.rollout_deployment_spec(spec), config)
    out += [
        Child(rl.rl_config_map(name, namespace, settings, gateway)),
        Child(rl.gateway_deployment(name, namespace, spec, gateway, config, client_of)),
        Child(rl.gateway_service(name, namespace, spec)),
    ]
    if spec.trainer.nodes > 1:
        out += [
            Child(rl.trainer_ranks_service(name, namespace, spec)),
            # never patched (a bound claim's spec is immutable) and not owned: it outlives the job, as the
            # StatefulSet's own claims do
            Child(rl.shared_checkpoint_claim(name, namespace, spec), create_only=True, owned=False),
        ]
    out.append(Child(rl.trainer_stateful_set(name, namespace, spec, settings, config, client_of)))
    if succeeded:
        for child in out:
            if child.kind in ("StatefulSet", "Deployment"):
                child.manifest["spec"]["replicas"] = 0
    return out


__all__ = ["Child", "deployment_children", "rljob_children", "worker_children"]
