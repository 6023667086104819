"""RLJob children: RL hyper-parameter ConfigMap, TITO gateway Deployment + Service, trainer StatefulSet (with a
headless Service and a shared checkpoint claim when it spans several pods), and
rollout workers when the job has no deploymentRef (the same worker manifests a GLM5Deployment gets).
"""

from __future__ import annotations

from typing import Any

from glm5_operator.api.deployment import GLM5DeploymentSpec, Workers
from glm5_operator.api.rljob import TRAINER_STATUS_PORT, RLJobSpec
from glm5_operator.config import OperatorConfig
from glm5_operator.render.common import (
    CONFIG_HASH_ANNOTATION,
    child_name,
    config_hash,
    container_security_context,
    flags_file,
    grpc_probe,
    labels,
    metadata,
    pod_security_context,
    selector,
)
from glm5_operator.render.network import (
    ADMIN_DIR,
    ADMIN_FILE,
    CLIENT_OF_LABEL,
    INTERNAL_TOKEN_FILE,
    SYNCS_INTO_LABEL,
    WEIGHTS_ROOT,
    admin_volume,
    internal_volume,
)
from glm5_operator.render.workers import (
    ACCELERATOR_RESOURCE,
    ALL_INTERFACES,
    POD_INDEX_LABEL,
    model_volume,
    worker_address,
)

GATEWAY_FILE = "gateway.json"  # `glm5 tito-gateway --config`
TRAINER_FILE = "trainer.json"  # `glm5 trainer --config`
RL_DIR = "/etc/glm5/rl"
CHECKPOINT_DIR = WEIGHTS_ROOT
TERMINATION_LOG = "/dev/termination-log"  # the container's termination message (Kubernetes' default path)


def checkpoint_claim(job: str, nodes: int = 1) -> str:
    """The trainer's checkpoint claim: one trainer pod's own, as the StatefulSet controller names it
    (<template>-<pod>); the one its pods share when it has several."""
    return f"checkpoints-{child_name(job, 'trainer')}" + ("-0" if nodes == 1 else "")


def trainer_ranks_service_name(job: str) -> str:
    return child_name(job, "trainer-ranks")


def trainer_master_addr(job: str, namespace: str) -> str:
    """Trainer pod 0's stable name (the headless Service's record for it): the rendezvous of a multi-pod trainer."""
    return f"{child_name(job, 'trainer')}-0.{trainer_ranks_service_name(job)}.{namespace}.svc"


def trainer_ranks_service(job: str, namespace: str, spec: RLJobSpec) -> dict[str, Any]:
    """Headless: each trainer pod's stable name resolves as soon as it runs (the others rendezvous at pod 0's
    before any is ready)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(trainer_ranks_service_name(job), namespace, job, "trainer"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(job, "trainer"),
            "ports": [{"name": "rendezvous", "port": spec.trainer.master_port, "targetPort": "rendezvous"}],
        },
    }


def shared_checkpoint_claim(job: str, namespace: str, spec: RLJobSpec) -> dict[str, Any]:
    """The claim every pod of a multi-pod trainer mounts: the ranks write one DCP checkpoint and each version
    together, and resume from it on any pod (a claim per pod cannot hold that)."""
    t = spec.trainer
    size = {"requests": {"storage": t.checkpoint_size}}
    claim: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": size}
    if t.checkpoint_storage_class:
        claim["storageClassName"] = t.checkpoint_storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(checkpoint_claim(job, t.nodes), namespace, job, "trainer"),
        "spec": claim,
    }


def synced_path(version: int) -> str:
    """Where `glm5 trainer` publishes a version, relative to its checkpoint directory (the claim's root)."""
    return f"actor_synced/v{version:06d}"


def rollout_instance(job: str) -> str:
    """Instance name of a job's own rollout workers (their children are named after it)."""
    return child_name(job, "rollout")


def rollout_deployment_spec(spec: RLJobSpec) -> GLM5DeploymentSpec:
    """The job's own rollout pool as a GLM5Deployment spec, so it renders exactly like served workers."""
    assert spec.rollout.workers is not None, "validated: deploymentRef xor workers"
    return GLM5DeploymentSpec(model=spec.policy, workers=spec.rollout.workers)


def rl_settings(job: str, namespace: str, spec: RLJobSpec, engines: str) -> dict[str, Any]:
    """`glm5 trainer` flags."""
    t, g = spec.trainer, spec.gateway
    eps_low, eps_high = t.trust_region()
    return {
        "job": job,
        "policy": spec.policy.path,
        "engines": engines,
        "gateway": f"{child_name(job, 'gateway')}.{namespace}.svc:{g.port}",
        # 0: train until the pod is stopped (SIGTERM: finish the step, publish, exit); restarts resume. N: the
        # job's total; the trainer then writes its completion to the termination log, where the operator reads it
        "steps": t.steps,
        "group-size": t.group_size,
        "groups-per-step": t.groups_per_step,
        "max-new-tokens": t.max_new_tokens,
        "eval-size": t.eval_size,
        "completion-file": TERMINATION_LOG,
        "status-port": TRAINER_STATUS_PORT,
        "status-host": ALL_INTERFACES,
        "learning-rate": t.learning_rate,
        "task-preset": t.task_preset,
        "eps-low": eps_low,
        "eps-high": eps_high,
        "staleness-limit": t.staleness_limit,
        "sync-interval-seconds": t.sync_interval_seconds,
        "sync-every-steps": t.sync_every_steps,
        "ema-decay": t.ema_decay,
        "checkpoint-dir": CHECKPOINT_DIR,
        "admin-token-file": f"{ADMIN_DIR}/{ADMIN_FILE}",  # the engines' token, sent with every weight push
        "internal-token-file": INTERNAL_TOKEN_FILE,  # theirs too, sent with every call to them
        # the workers share no volume with the trainer (its checkpoint claim is ReadWriteOnce, and a referenced
        # deployment's workers were rendered without it): each version goes to them over the network, from the
        # trainer ranks' shards (collective; --sync-address is the pod's IP, set in the container's args) or as the
        # published files over gRPC (stream)
        "weights-transport": t.weight_transport,
        **({"sync-port": t.sync_port} if t.weight_transport == "collective" else {}),
        "dataset": spec.dataset.uri,
        "environment": spec.dataset.environment,
        # one rank per device, the policy sharded over them (FSDP2); rank 0 runs the loop
        "nproc-per-node": t.devices,
        # over several pods: pod i is node i (--node-rank and --master-addr are in each pod's args)
        **({"nnodes": t.nodes, "master-port": t.master_port} if t.nodes > 1 else {}),
        "activation-checkpointing": t.activation_checkpointing,
    }


def gateway_settings(spec: RLJobSpec, engines: str) -> dict[str, Any]:
    """`glm5 tito-gateway` flags."""
    g = spec.gateway
    return {
        "engine-dns": engines,
        "host": ALL_INTERFACES,
        "port": g.port,
        "virtual-node-reserve": g.virtual_node_reserve,
        "load-bound": g.load_bound,
        "tokenizer-fingerprint": g.tokenizer_fingerprint,
        "internal-token-file": INTERNAL_TOKEN_FILE,  # the engines answer only callers that send it
    }


def rl_config_map(job: str, namespace: str, settings: dict[str, Any], gateway: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(child_name(job, "rl"), namespace, job, "trainer"),
        "data": {TRAINER_FILE: flags_file(settings), GATEWAY_FILE: flags_file(gateway)},
    }


def _pod(
    job: str, component: str, image: str, config: OperatorConfig, args: list[str], settings: dict[str, Any],
    ports: list[dict[str, Any]], resources: dict[str, Any], probe_port: int | None, config_file: str, client_of: str,
) -> dict[str, Any]:  # fmt: skip
    container: dict[str, Any] = {
        "name": component,
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "args": [*args, "--config", f"{RL_DIR}/{config_file}"],
        "ports": ports,
        "resources": resources,
        "volumeMounts": [
            {"name": "rl", "mountPath": RL_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": container_security_context(),
    }
    if probe_port is not None:
        container["readinessProbe"] = grpc_probe(probe_port, 5, 3)
        container["livenessProbe"] = grpc_probe(probe_port, 20, 3)
    internal, internal_mount = internal_volume(client_of)  # the token of the workers it calls
    container["volumeMounts"].append(internal_mount)
    return {
        "metadata": {
            "labels": {**labels(job, component), CLIENT_OF_LABEL: client_of},  # the workers' NetworkPolicy
            "annotations": {CONFIG_HASH_ANNOTATION: config_hash(settings)},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": pod_security_context(),
            "containers": [container],
            "volumes": [
                {"name": "rl", "configMap": {"name": child_name(job, "rl")}},
                {"name": "tmp", "emptyDir": {}},
                internal,
            ],
        },
    }


def gateway_deployment(
    job: str, namespace: str, spec: RLJobSpec, settings: dict[str, Any], config: OperatorConfig, client_of: str
) -> dict[str, Any]:
    g = spec.gateway
    ports = [{"name": "grpc", "containerPort": g.port, "protocol": "TCP"}]
    resources = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
    template = _pod(
        job,
        "gateway",
        config.image,
        config,
        ["tito-gateway"],
        settings,
        ports,
        resources,
        g.port,
        GATEWAY_FILE,
        client_of,
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(child_name(job, "gateway"), namespace, job, "gateway"),
        "spec": {"replicas": g.replicas, "selector": {"matchLabels": selector(job, "gateway")}, "template": template},
    }


def gateway_service(job: str, namespace: str, spec: RLJobSpec) -> dict[str, Any]:
    port = spec.gateway.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(child_name(job, "gateway"), namespace, job, "gateway"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(job, "gateway"),
            "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "appProtocol": "grpc"}],
        },
    }


def trainer_stateful_set(
    job: str, namespace: str, spec: RLJobSpec, settings: dict[str, Any], config: OperatorConfig, client_of: str
) -> dict[str, Any]:
    t = spec.trainer
    # on CPU each rank is a process that wants a core of its own
    cpus = str(t.devices) if t.accelerator == "cpu" else "1"
    resources: dict[str, Any] = {"requests": {"cpu": cpus, "memory": "4Gi"}}
    extended = ACCELERATOR_RESOURCE.get(t.accelerator)
    if extended:
        resources = {"limits": {extended: t.devices}, "requests": {**resources["requests"], extended: t.devices}}
    template = _pod(
        job,
        "trainer",
        t.image or config.image,
        config,
        ["trainer"],
        settings,
        [],
        resources,
        None,
        TRAINER_FILE,
        client_of,
    )
    trainer = template["spec"]["containers"][0]
    trainer["volumeMounts"].append({"name": "checkpoints", "mountPath": CHECKPOINT_DIR})
    policy_volumes, policy_mounts = model_volume(spec.policy)  # the starting policy, as the workers mount it
    template["spec"]["volumes"] += policy_volumes
    trainer["volumeMounts"] += policy_mounts
    if spec.dataset.pvc_name:
        template["spec"]["volumes"].append(
            {"name": "dataset", "persistentVolumeClaim": {"claimName": spec.dataset.pvc_name, "readOnly": True}}
        )
        trainer["volumeMounts"].append({"name": "dataset", "mountPath": spec.dataset.mount_path, "readOnly": True})
    admin, admin_mount = admin_volume(client_of)  # the token of the workers it pushes weights to
    template["spec"]["volumes"].append(admin)
    trainer["volumeMounts"].append(admin_mount)
    trainer["ports"] = [{"name": "status", "containerPort": TRAINER_STATUS_PORT, "protocol": "TCP"}]
    if t.weight_transport == "collective":
        # the rendezvous the workers reach is the pod's own address (the store listens there and nowhere else)
        trainer["env"] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        trainer["args"] += ["--sync-address", "$(POD_IP)"]
        trainer["ports"].append({"name": "sync", "containerPort": t.sync_port, "protocol": "TCP"})
        template["metadata"]["labels"][SYNCS_INTO_LABEL] = client_of  # the workers' NetworkPolicy admits it
    trainer["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": "status"}, "periodSeconds": 10,
                                 "failureThreshold": 3}  # fmt: skip
    trainer["terminationMessagePath"] = TERMINATION_LOG
    trainer["terminationMessagePolicy"] = "File"
    sts: dict[str, Any] = {
        "replicas": t.nodes,
        "serviceName": child_name(job, "gateway"),
        "selector": {"matchLabels": selector(job, "trainer")},
        "template": template,
    }
    if t.nodes == 1:
        # Versioned checkpoints (actor_synced / actor_ema) outlive trainer restarts.
        sts["volumeClaimTemplates"] = [
            {
                "metadata": {"name": "checkpoints"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": t.checkpoint_size}}},
            }
        ]
    else:
        # pod i is node i; all start at once (pod 0 is ready only once every node has joined)
        sts["serviceName"] = trainer_ranks_service_name(job)
        sts["podManagementPolicy"] = "Parallel"
        template["spec"]["volumes"].append(
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint_claim(job, t.nodes)}}
        )
        trainer.setdefault("env", []).append(
            {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}}
        )
        trainer["args"] += ["--node-rank", "$(POD_INDEX)", "--master-addr", trainer_master_addr(job, namespace)]
        trainer["ports"].append({"name": "rendezvous", "containerPort": t.master_port, "protocol": "TCP"})
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(child_name(job, "trainer"), namespace, job, "trainer"),
        "spec": sts,
    }


def engines_address(
    job: str, namespace: str, spec: RLJobSpec, ref_spec: GLM5DeploymentSpec | None
) -> tuple[str, Workers]:
    """Where the gateway finds its rollout engines: the referenced deployment's workers or the job's own."""
    if spec.rollout.deployment_ref is not None:
        assert ref_spec is not None, "the handler resolves the reference first"
        return worker_address(spec.rollout.deployment_ref, namespace, ref_spec.workers.port), ref_spec.workers
    own = rollout_deployment_spec(spec)
    return worker_address(rollout_instance(job), namespace, own.workers.port), own.workers
