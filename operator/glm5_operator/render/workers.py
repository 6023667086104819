"""Worker children of a GLM5Deployment: engine ConfigMap, rank-table ConfigMap, StatefulSets, headless
Services, PodDisruptionBudget.

Pod i of the `<name>-worker` StatefulSet is rank 0 of model replica i: it serves gRPC and starts the replica's
other ranks on its node (`glm5 worker --tensor-parallel-size devicesPerReplica`), so `kubectl scale glm5d`
maps to StatefulSet replicas. A replica larger than a node (devicesPerReplica > devicesPerNode) adds one
StatefulSet per further node, `<name>-worker-node<k>`, whose pod i runs ranks k * devicesPerNode.. of replica
i, all followers, reaching pod i of the first set through the `<name>-worker-ranks` Service (its per-pod DNS
names exist before the pods are ready: rank 0 is not ready until every rank has joined). Pods run
`glm5 worker --config` with the engine ConfigMap; a hash of it in the pod template rolls the pods when the
configuration changes.

Where the cluster serves LeaderWorkerSets (workers.multiNode), a multi-pod replica is instead one group of the
`<name>-lws` LeaderWorkerSet: its leader (worker index 0, component `worker`) is rank 0 and serves, its workers
(component `worker-node`) run the other nodes' ranks with `--node-rank $(LWS_WORKER_INDEX)` and reach the leader at
$(LWS_LEADER_ADDRESS); a group restarts as a whole when one of its pods does (RecreateGroupOnPodRestart), and the
group index plays the StatefulSet ordinal's part (POD_INDEX: the replica, its rank table).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from glm5_operator.api.deployment import GLM5DeploymentSpec, ModelSource, Workers
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
    INTERNAL_TOKEN_FILE,
    WEIGHTS_ROOT,
    admin_volume,
    internal_volume,
    tls_settings,
    tls_volume,
)

COMPONENT = "worker"
ALL_INTERFACES = "0.0.0.0"  # outside Kubernetes the servers default to 127.0.0.1
ENGINE_FILE = "engine.json"
ENGINE_DIR = "/etc/glm5/engine"
RANK_TABLE_DIR = "/etc/glm5/ranktable"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
NODE_RANK_LABEL = "glm5.ai/node-rank"  # which node of its replica a worker pod is (0: the one that serves)
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # the LeaderWorkerSet controller's pod labels
LWS_WORKER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_FOLLOWER = f"{COMPONENT}-node"  # the component of a LeaderWorkerSet group's non-leader pods
ACCELERATOR_RESOURCE = {"ascend-910b": "huawei.com/Ascend910", "nvidia": "nvidia.com/gpu"}
DEVICE_FLAG = {"ascend-910b": "npu", "nvidia": "cuda", "cpu": "cpu"}
SHUTDOWN_GRACE_S = 30


def worker_name(instance: str) -> str:
    return child_name(instance, COMPONENT)


def worker_node_name(instance: str, node_rank: int) -> str:
    return worker_name(instance) if node_rank == 0 else child_name(instance, f"{COMPONENT}-node{node_rank}")


def node_component(node_rank: int) -> str:
    return COMPONENT if node_rank == 0 else f"{COMPONENT}-node{node_rank}"


def lws_name(instance: str) -> str:
    return child_name(instance, "lws")


def worker_components(spec: Workers, lws: bool) -> list[str]:
    """The components of a replica's pods: rank 0's first."""
    if lws and spec.pods_per_replica > 1:
        return [COMPONENT, LWS_FOLLOWER]
    return [node_component(k) for k in range(spec.pods_per_replica)]


def ranks_service_name(instance: str) -> str:
    return child_name(instance, f"{COMPONENT}-ranks")


def engine_config_name(instance: str) -> str:
    return child_name(instance, "engine")


def rank_table_name(instance: str) -> str:
    return child_name(instance, "ranktable")


def rank_table_key(replica: int) -> str:
    return f"replica-{replica}.json"


def worker_address(instance: str, namespace: str, port: int) -> str:
    """DNS name of the headless Service: one A record per ready worker pod."""
    return f"{worker_name(instance)}.{namespace}.svc:{port}"


def engine_settings(spec: GLM5DeploymentSpec, served_name: str) -> dict[str, Any]:
    """`glm5 worker` flags, from the spec (see `glm5 worker --help`); the same for every node of a replica (a
    pod's node rank and its rank 0's address come as arguments)."""
    m, w, kv, sa = spec.model, spec.workers, spec.kv_cache, spec.sparse_attention
    rope = m.rope_scaling
    parallel = w.devices_per_replica > 1
    nodes = w.pods_per_replica
    return {
        "model": m.path,
        "served-model-name": m.served_name or served_name,
        "host": ALL_INTERFACES,  # the pod's own network namespace; the NetworkPolicy decides who reaches it
        "port": w.port,
        "device": DEVICE_FLAG[w.accelerator],
        "dtype": m.dtype,
        "quantization": m.quantization,
        "max-model-len": m.max_model_len,
        "default-max-new-tokens": m.max_new_tokens,
        "rope-scaling": rope.type if rope else None,
        "rope-factor": rope.factor if rope else None,
        "rope-original-max-position-embeddings": rope.original_max_position_embeddings if rope else None,
        "kv-cache-bytes": kv.bytes,
        "no-kv-int8-tier": not kv.int8_tier,
        "kv-cache-dtype": kv.dtype,
        "kv-index-dtype": kv.index_dtype,
        "l1-tokens": kv.l1_tokens,
        "block-size": kv.block_size,
        "no-prefix-caching": not kv.prefix_caching,
        "max-num-seqs": w.max_num_seqs,
        "dense-warmup-tokens": sa.dense_warmup_tokens,
        "dynamic-sparsity": sa.dynamic_sparsity,
        "kernels": sa.kernels,
        "ascend-temperature-floor": spec.sampling.ascend_temperature_floor,
        "shutdown-grace": SHUTDOWN_GRACE_S,
        "tensor-parallel-size": w.devices_per_replica,
        "expert-parallel": w.expert_parallel if parallel else None,
        "collective-timeout": w.collective_timeout_seconds if parallel else None,
        "nnodes": nodes if nodes > 1 else None,
        "master-port": w.rendezvous_port if nodes > 1 else None,
        **tls_settings(spec),
        # every call but health checks: only the instance's routers and the RL jobs' gateways and trainers
        "internal-token-file": INTERNAL_TOKEN_FILE,
        # UpdateWeights: only holders of the instance's admin token, only from where RL trainers publish
        "admin-token-file": f"{ADMIN_DIR}/{ADMIN_FILE}",
        "weights-root": WEIGHTS_ROOT,
    }


def engine_config_map(instance: str, namespace: str, spec: GLM5DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(engine_config_name(instance), namespace, instance, COMPONENT),
        "data": {ENGINE_FILE: flags_file(engine_settings(spec, instance))},
    }


def rank_table_config_map(instance: str, namespace: str, tables: dict[int, dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(rank_table_name(instance), namespace, instance, COMPONENT),
        "data": {rank_table_key(r): json.dumps(t, indent=2) + "\n" for r, t in sorted(tables.items())},
    }


def _resources(w: Workers) -> dict[str, Any]:
    res: dict[str, Any] = copy.deepcopy(w.resources) if w.resources else {}
    # a request so the scheduler places workers on nodes with room; no memory limit by default: what a checkpoint
    # needs on the host varies by model and format (set workers.resources to cap it)
    requests = res.setdefault("requests", {})
    requests.setdefault("cpu", "1")
    requests.setdefault("memory", "2Gi")
    extended = ACCELERATOR_RESOURCE.get(w.accelerator)
    if extended:
        # Extended resources must have equal requests and limits.
        res.setdefault("limits", {})[extended] = w.node_devices
        res.setdefault("requests", {})[extended] = w.node_devices
    return res


def _env(w: Workers, lws: bool) -> list[dict[str, Any]]:
    index = LWS_GROUP_LABEL if lws else POD_INDEX_LABEL  # the replica the pod belongs to
    env: list[dict[str, Any]] = [
        {"name": "GLM5_HOME", "value": "/tmp/glm5"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{index}']"}}},
    ]
    if w.accelerator == "ascend-910b":
        # Only variables CANN documents. torch_npu builds the HCCL communicator from RANK_TABLE_FILE (rank-table
        # mode), so the ring is the rank_id order the operator wrote; the worker waits for the table to be
        # complete and hands torch_npu a regular-file copy of it (a ConfigMap file is a symbolic link, which
        # torch_npu refuses).
        env += [
            # the worker waits for a table that lists its own address, not a replaced pod's
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # CANN logs to stdout flood the node's log buffers on long runs.
            {"name": "ASCEND_SLOG_PRINT_TO_STDOUT", "value": "0"},
            {"name": "RANK_TABLE_FILE", "value": f"{RANK_TABLE_DIR}/replica-$(POD_INDEX).json"},
            {"name": "RANK_SIZE", "value": str(w.devices_per_replica)},
            {"name": "HCCL_CONNECT_TIMEOUT", "value": "1800"},
            # how long a device waits for the others in a collective: the worker's collective timeout
            {"name": "HCCL_EXEC_TIMEOUT", "value": str(w.collective_timeout_seconds)},
            {"name": "HCCL_WHITELIST_DISABLE", "value": "1"},
        ]
        if w.ring_order is not None:
            # a manual ring: the ring algorithm between servers (level0, inside a server, only takes NA)
            env.append({"name": "HCCL_ALGO", "value": "level0:NA;level1:ring"})
    return env


def model_volume(m: ModelSource) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The checkpoint's volume, mounted read-only at its path (none: the path is in the image)."""
    if m.pvc_name:
        volume: dict[str, Any] = {"name": "model", "persistentVolumeClaim": {"claimName": m.pvc_name, "readOnly": True}}
    elif m.host_path:
        volume = {"name": "model", "hostPath": {"path": m.host_path, "type": "Directory"}}
    else:
        return [], []
    return [volume], [{"name": "model", "mountPath": m.path, "readOnly": True}]


def _volumes(instance: str, spec: GLM5DeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    m = spec.model
    volumes: list[dict[str, Any]] = [
        {"name": "engine", "configMap": {"name": engine_config_name(instance)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "engine", "mountPath": ENGINE_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    model_volumes, model_mounts = model_volume(m)
    volumes += model_volumes
    mounts += model_mounts
    # pushed weights (Worker.PushWeights) are staged here, read into memory and deleted
    volumes.append({"name": "weights", "emptyDir": {}})
    mounts.append({"name": "weights", "mountPath": WEIGHTS_ROOT})
    tls_volumes, tls_mounts = tls_volume(spec)
    volumes += tls_volumes
    mounts += tls_mounts
    for volume, mount in (internal_volume(instance), admin_volume(instance)):
        volumes.append(volume)
        mounts.append(mount)
    if spec.workers.accelerator == "ascend-910b":
        volumes.append({"name": "ranktable", "configMap": {"name": rank_table_name(instance)}})
        mounts.append({"name": "ranktable", "mountPath": RANK_TABLE_DIR, "readOnly": True})
    return volumes, mounts


def worker_pod_template(
    instance: str, namespace: str, spec: GLM5DeploymentSpec, config: OperatorConfig, node_rank: int, lws: bool
) -> dict[str, Any]:
    """The pods of node `node_rank` of a replica (under a LeaderWorkerSet: 0 the leader, 1 every other node).
    Node 0 serves; the others run follower ranks only (no gRPC server, so no gRPC probes: their process exits when
    the replica fails)."""
    w = spec.workers
    volumes, mounts = _volumes(instance, spec)
    probe_period = 10
    args = ["worker", "--config", f"{ENGINE_DIR}/{ENGINE_FILE}"]
    multi_node = w.pods_per_replica > 1
    if multi_node and lws:
        args += ["--master-addr", "$(LWS_LEADER_ADDRESS)"]
    elif multi_node:
        first = f"{worker_name(instance)}-$(POD_INDEX).{ranks_service_name(instance)}.{namespace}.svc"
        args += ["--master-addr", first]
    if node_rank > 0:
        args += ["--node-rank", "$(LWS_WORKER_INDEX)" if lws else str(node_rank)]
    container: dict[str, Any] = {
        "name": COMPONENT,
        "image": w.image or config.image,
        "imagePullPolicy": config.image_pull_policy,
        "args": args,
        "ports": [{"name": "grpc", "containerPort": w.port, "protocol": "TCP"}],
        "env": _env(w, lws),
        "resources": _resources(w),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    if node_rank == 0:
        if multi_node:
            container["ports"].append({"name": "rendezvous", "containerPort": w.rendezvous_port, "protocol": "TCP"})
        # the kubelet's gRPC probes speak plain text: under TLS they ask the health-only port
        probe_port = spec.security.health_port if spec.security.tls_secret else w.port
        if spec.security.tls_secret:
            container["ports"].append({"name": "health", "containerPort": probe_port, "protocol": "TCP"})
        # Loading a 744B checkpoint takes minutes: the startup probe holds liveness off until it is served.
        container["startupProbe"] = grpc_probe(
            probe_port, probe_period, max(1, config.worker_startup_seconds // probe_period)
        )
        container["readinessProbe"] = grpc_probe(probe_port, 5, 3)
        container["livenessProbe"] = grpc_probe(probe_port, 20, 6)
    else:
        del container["ports"]
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": SHUTDOWN_GRACE_S + 15,
        "containers": [container],
        "volumes": volumes,
    }
    if w.node_selector:
        pod_spec["nodeSelector"] = dict(w.node_selector)
    if w.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(w.tolerations)
    component = worker_components(w, lws)[min(node_rank, 1)] if lws else node_component(node_rank)
    pod_labels = labels(instance, component) | ({} if lws else {NODE_RANK_LABEL: str(node_rank)})
    return {
        "metadata": {
            "labels": pod_labels,
            "annotations": {CONFIG_HASH_ANNOTATION: config_hash(engine_settings(spec, instance))},
        },
        "spec": pod_spec,
    }


def worker_stateful_set(
    instance: str, namespace: str, spec: GLM5DeploymentSpec, config: OperatorConfig, node_rank: int = 0
) -> dict[str, Any]:
    """Node `node_rank` of every replica: pod i of it belongs to replica i."""
    w = spec.workers
    component = node_component(node_rank)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(worker_node_name(instance, node_rank), namespace, instance, component),
        "spec": {
            "replicas": w.replicas,
            # the first node's pods need DNS names before they are ready (the other nodes connect to them)
            "serviceName": ranks_service_name(instance) if w.pods_per_replica > 1 else worker_name(instance),
            # Replicas are independent rings: start and replace them in parallel.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector(instance, component)},
            "template": worker_pod_template(instance, namespace, spec, config, node_rank, lws=False),
        },
    }


def worker_leader_worker_set(
    instance: str, namespace: str, spec: GLM5DeploymentSpec, config: OperatorConfig
) -> dict[str, Any]:
    """Every multi-pod replica as one group: leader = node 0, workers = nodes 1.. in worker-index order."""
    w = spec.workers
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": metadata(lws_name(instance), namespace, instance, COMPONENT),
        "spec": {
            "replicas": w.replicas,
            # the leader's DNS name exists as soon as it is created: the workers start beside it, not after it
            "startupPolicy": "LeaderCreated",
            # one replica at a time, as the PodDisruptionBudget allows
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": w.pods_per_replica,
                # a replica is one collective: a rank that restarts alone could never rejoin it
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": worker_pod_template(instance, namespace, spec, config, 0, lws=True),
                "workerTemplate": worker_pod_template(instance, namespace, spec, config, 1, lws=True),
            },
        },
    }


def worker_stateful_sets(
    instance: str, namespace: str, spec: GLM5DeploymentSpec, config: OperatorConfig
) -> list[dict[str, Any]]:
    return [worker_stateful_set(instance, namespace, spec, config, k) for k in range(spec.workers.pods_per_replica)]


def ranks_service(instance: str, namespace: str, spec: GLM5DeploymentSpec) -> dict[str, Any]:
    """Headless, publishing pods before they are ready: the per-pod names other nodes rendezvous at."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ranks_service_name(instance), namespace, instance, COMPONENT),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(instance, COMPONENT),
            "ports": [{"name": "rendezvous", "port": spec.workers.rendezvous_port, "targetPort": "rendezvous"}],
        },
    }


def worker_service(instance: str, namespace: str, spec: GLM5DeploymentSpec) -> dict[str, Any]:
    """Headless: the router resolves one address per ready worker pod."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(worker_name(instance), namespace, instance, COMPONENT),
        "spec": {
            "clusterIP": "None",
            "selector": selector(instance, COMPONENT),
            "ports": [{"name": "grpc", "port": spec.workers.port, "targetPort": "grpc", "appProtocol": "grpc"}],
        },
    }


def worker_pdb(instance: str, namespace: str) -> dict[str, Any]:
    """Voluntary disruptions (node drains) take one model replica at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(worker_name(instance), namespace, instance, COMPONENT),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(instance, COMPONENT)}},
    }
