"""Worker children of a GLM5Deployment: engine ConfigMap, rank-table ConfigMap, StatefulSet, headless
Service, PodDisruptionBudget.

One StatefulSet per GLM5Deployment; each pod is one model replica holding all `devicesPerReplica` devices of
its HCCL ring, so `kubectl scale glm5d` maps to StatefulSet replicas. Pods run `glm5 worker --config` with
the engine ConfigMap; a hash of it in the pod template rolls the pods when the configuration changes.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from glm5_operator.api.deployment import GLM5DeploymentSpec, Workers
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

COMPONENT = "worker"
ENGINE_FILE = "engine.json"
ENGINE_DIR = "/etc/glm5/engine"
RANK_TABLE_DIR = "/etc/glm5/ranktable"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
ACCELERATOR_RESOURCE = {"ascend-910b": "huawei.com/Ascend910", "nvidia": "nvidia.com/gpu"}
DEVICE_FLAG = {"ascend-910b": "npu", "nvidia": "cuda", "cpu": "cpu"}
SHUTDOWN_GRACE_S = 30


def worker_name(instance: str) -> str:
    return child_name(instance, COMPONENT)


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
    """`glm5 worker` flags, from the spec (see `glm5 worker --help`)."""
    m, w, kv, sa = spec.model, spec.workers, spec.kv_cache, spec.sparse_attention
    rope = m.rope_scaling
    return {
        "model": m.path,
        "served-model-name": m.served_name or served_name,
        "port": w.port,
        "device": DEVICE_FLAG[w.accelerator],
        "dtype": m.dtype,
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
    extended = ACCELERATOR_RESOURCE.get(w.accelerator)
    if extended:
        # Extended resources must have equal requests and limits.
        res.setdefault("limits", {})[extended] = w.devices_per_replica
        res.setdefault("requests", {})[extended] = w.devices_per_replica
    return res


def _env(w: Workers) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "GLM5_HOME", "value": "/tmp/glm5"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}},
    ]
    if w.accelerator == "ascend-910b":
        ring = w.ring_order if w.ring_order is not None else list(range(w.devices_per_replica))
        env += [
            # CANN logs to stdout flood the node's log buffers on long runs (source material, 3.1).
            {"name": "ASCEND_SLOG_PRINT_TO_STDOUT", "value": "0"},
            {"name": "RANK_TABLE_FILE", "value": f"{RANK_TABLE_DIR}/replica-$(POD_INDEX).json"},
            {"name": "RANK_SIZE", "value": str(w.devices_per_replica)},
            # The ring is manual: ranks in hccl.json follow ringOrder; automatic topology discovery and
            # asynchronous all-reduce are off (source material: deadlocks on long contexts otherwise).
            {"name": "HCCL_RING_ORDER", "value": ",".join(str(r) for r in ring)},
            {"name": "HCCL_ASYNC_ALLREDUCE", "value": "0"},
            {"name": "HCCL_CONNECT_TIMEOUT", "value": "1800"},
            {"name": "HCCL_WHITELIST_DISABLE", "value": "1"},
        ]
    return env


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
    if m.pvc_name:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": m.pvc_name, "readOnly": True}})
    elif m.host_path:
        volumes.append({"name": "model", "hostPath": {"path": m.host_path, "type": "Directory"}})
    if m.pvc_name or m.host_path:
        mounts.append({"name": "model", "mountPath": m.path, "readOnly": True})
    if spec.workers.accelerator == "ascend-910b":
        volumes.append({"name": "ranktable", "configMap": {"name": rank_table_name(instance)}})
        mounts.append({"name": "ranktable", "mountPath": RANK_TABLE_DIR, "readOnly": True})
    return volumes, mounts


def worker_stateful_set(
    instance: str, namespace: str, spec: GLM5DeploymentSpec, config: OperatorConfig
) -> dict[str, Any]:
    w = spec.workers
    volumes, mounts = _volumes(instance, spec)
    probe_period = 10
    container = {
        "name": COMPONENT,
        "image": w.image or config.image,
        "imagePullPolicy": config.image_pull_policy,
        "args": ["worker", "--config", f"{ENGINE_DIR}/{ENGINE_FILE}"],
        "ports": [{"name": "grpc", "containerPort": w.port, "protocol": "TCP"}],
        "env": _env(w),
        "resources": _resources(w),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        # Loading a 744B checkpoint takes minutes: the startup probe holds liveness off until it is served.
        "startupProbe": grpc_probe(w.port, probe_period, max(1, config.worker_startup_seconds // probe_period)),
        "readinessProbe": grpc_probe(w.port, 5, 3),
        "livenessProbe": grpc_probe(w.port, 20, 6),
    }
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
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(worker_name(instance), namespace, instance, COMPONENT),
        "spec": {
            "replicas": w.replicas,
            "serviceName": worker_name(instance),
            # Replicas are independent rings: start and replace them in parallel.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector(instance, COMPONENT)},
            "template": {
                "metadata": {
                    "labels": labels(instance, COMPONENT),
                    "annotations": {CONFIG_HASH_ANNOTATION: config_hash(engine_settings(spec, instance))},
                },
                "spec": pod_spec,
            },
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
