"""Router children of a GLM5Deployment: router ConfigMap, Deployment, Service (gRPC + OpenAI HTTP).

The router runs `glm5 router --config router.json`; the settings below are its flags (the contract with
services/router). It finds workers through the headless worker Service's DNS records.
"""

from __future__ import annotations

from typing import Any

from glm5_operator.api.deployment import GLM5DeploymentSpec
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
from glm5_operator.render.workers import worker_address

COMPONENT = "router"
ROUTER_FILE = "router.json"
ROUTER_DIR = "/etc/glm5/router"
SM4_DIR = "/etc/glm5/sm4"
REDIS_URL_ENV = "GLM5_REDIS_URL"


def router_name(instance: str) -> str:
    return child_name(instance, COMPONENT)


def router_settings(instance: str, namespace: str, spec: GLM5DeploymentSpec) -> dict[str, Any]:
    r = spec.router
    cb, q, b = r.circuit_breaker, r.queues, r.batching
    return {
        "worker-dns": worker_address(instance, namespace, spec.workers.port),
        "served-model-name": spec.model.served_name or instance,
        "grpc-port": r.grpc_port,
        "http-port": r.http_port,
        "default-max-new-tokens": spec.model.max_new_tokens,
        "token-budget": b.token_budget,
        "max-wait-ms": b.max_wait_ms,
        "short-max-prompt-tokens": q.short_max_prompt_tokens,
        "long-min-prompt-tokens": q.long_min_prompt_tokens,
        "long-pause-kv-usage": q.long_pause_kv_usage,
        "max-queued": q.max_queued,
        "redis-url": r.redis.url if r.redis else None,
        "redis-url-env": REDIS_URL_ENV if r.redis and r.redis.url_secret else None,
        "breaker-kv-fragmentation": cb.kv_fragmentation,
        "breaker-entropy-drift": cb.entropy_drift,
        "breaker-token-jitter-ms": cb.token_jitter_ms,
        "breaker-sustained-seconds": cb.sustained_seconds,
        "breaker-half-open-share": cb.half_open_share,
        "sm4-key-dir": SM4_DIR if r.sm4_key_secret else None,
        "thinking-policy": r.thinking_policy,
    }


def router_config_map(instance: str, namespace: str, spec: GLM5DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(child_name(instance, "router-config"), namespace, instance, COMPONENT),
        "data": {ROUTER_FILE: flags_file(router_settings(instance, namespace, spec))},
    }


def router_deployment(
    instance: str, namespace: str, spec: GLM5DeploymentSpec, config: OperatorConfig
) -> dict[str, Any]:
    r = spec.router
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": child_name(instance, "router-config")}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": ROUTER_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if r.sm4_key_secret:
        volumes.append({"name": "sm4", "secret": {"secretName": r.sm4_key_secret, "defaultMode": 0o400}})
        mounts.append({"name": "sm4", "mountPath": SM4_DIR, "readOnly": True})
    env: list[dict[str, Any]] = []
    if r.redis and r.redis.url_secret:
        ref = r.redis.url_secret
        env.append({"name": REDIS_URL_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    container: dict[str, Any] = {
        "name": COMPONENT,
        "image": r.image or config.image,
        "imagePullPolicy": config.image_pull_policy,
        "args": ["router", "--config", f"{ROUTER_DIR}/{ROUTER_FILE}"],
        "ports": [
            {"name": "grpc", "containerPort": r.grpc_port, "protocol": "TCP"},
            {"name": "http", "containerPort": r.http_port, "protocol": "TCP"},
        ],
        "env": env,
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        "readinessProbe": grpc_probe(r.grpc_port, 5, 3),
        "livenessProbe": grpc_probe(r.grpc_port, 20, 3),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(router_name(instance), namespace, instance, COMPONENT),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": selector(instance, COMPONENT)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": labels(instance, COMPONENT),
                    "annotations": {CONFIG_HASH_ANNOTATION: config_hash(router_settings(instance, namespace, spec))},
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security_context(),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def router_service(instance: str, namespace: str, spec: GLM5DeploymentSpec) -> dict[str, Any]:
    r = spec.router
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(router_name(instance), namespace, instance, COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(instance, COMPONENT),
            "ports": [
                {"name": "grpc", "port": r.grpc_port, "targetPort": "grpc", "appProtocol": "grpc"},
                {"name": "http", "port": r.http_port, "targetPort": "http", "appProtocol": "http"},
            ],
        },
    }


def router_endpoints(instance: str, namespace: str, spec: GLM5DeploymentSpec) -> dict[str, str]:
    host = f"{router_name(instance)}.{namespace}.svc"
    return {"grpc": f"{host}:{spec.router.grpc_port}", "http": f"http://{host}:{spec.router.http_port}/v1"}
