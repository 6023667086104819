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
from glm5_operator.render.network import (
    API_KEYS_DIR,
    API_KEYS_FILE,
    INTERNAL_TOKEN_FILE,
    internal_volume,
    tls_settings,
    tls_volume,
)
from glm5_operator.render.workers import ALL_INTERFACES, worker_address, worker_name

COMPONENT = "router"
ROUTER_FILE = "router.json"
ROUTER_DIR = "/etc/glm5/router"
ROUTER_SERVICE = "glm5.v1.Router"  # the gRPC service whose health says ready (proto/glm5/v1/router.proto)
SM4_DIR = "/etc/glm5/sm4"
REDIS_DIR = "/etc/glm5/redis"
REDIS_FILE = "url"


def router_name(instance: str) -> str:
    return child_name(instance, COMPONENT)


def router_settings(instance: str, namespace: str, spec: GLM5DeploymentSpec) -> dict[str, Any]:
    r = spec.router
    cb, q, b = r.circuit_breaker, r.queues, r.batching
    sec = spec.security
    tls = tls_settings(spec)
    return {
        "worker-dns": worker_address(instance, namespace, spec.workers.port),
        "host": ALL_INTERFACES,
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
        "redis-url-file": f"{REDIS_DIR}/{REDIS_FILE}" if r.redis and r.redis.url_secret else None,
        "breaker-kv-fragmentation": cb.kv_fragmentation,
        "breaker-entropy-drift": cb.entropy_drift,
        "breaker-token-jitter-ms": cb.token_jitter_ms,
        "breaker-spec-window-tokens": cb.spec_window_tokens,
        "breaker-spec-acceptance-drop": cb.spec_acceptance_drop,
        "breaker-spec-acceptance-max": cb.spec_acceptance_max,
        "breaker-sustained-seconds": cb.sustained_seconds,
        "breaker-half-open-share": cb.half_open_share,
        "sm4-key-dir": SM4_DIR if r.sm4_key_secret else None,
        "thinking-policy": r.thinking_policy,
        "routing": r.routing,
        "cache-index-blocks": r.cache_index_blocks,
        **tls,
        # workers are dialled by pod address: their certificate names their Service
        "tls-server-name": f"{worker_name(instance)}.{namespace}.svc" if tls else None,
        "internal-token-file": INTERNAL_TOKEN_FILE,  # the workers answer only callers that send it
        "http-tls-cert": tls["tls-cert"] if sec.https else None,
        "http-tls-key": tls["tls-key"] if sec.https else None,
        "api-key-file": f"{API_KEYS_DIR}/{API_KEYS_FILE}" if sec.api_key_secret else None,
        "require-sealed": sec.require_sealed or None,
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
    # Secrets as files, not env vars: a process's environment is easier to leak (crash dumps, /proc)
    if r.redis and r.redis.url_secret:
        _secret_file(volumes, mounts, "redis", r.redis.url_secret.name, r.redis.url_secret.key, REDIS_DIR, REDIS_FILE)
    if spec.security.api_key_secret:
        ref = spec.security.api_key_secret
        _secret_file(volumes, mounts, "api-keys", ref.name, ref.key, API_KEYS_DIR, API_KEYS_FILE)
    tls_volumes, tls_mounts = tls_volume(spec)
    volumes += tls_volumes
    mounts += tls_mounts
    internal, internal_mount = internal_volume(instance)
    volumes.append(internal)
    mounts.append(internal_mount)
    probe_port = spec.security.health_port if spec.security.tls_secret else r.grpc_port
    ports = [
        {"name": "grpc", "containerPort": r.grpc_port, "protocol": "TCP"},
        {"name": "http", "containerPort": r.http_port, "protocol": "TCP"},
    ]
    if spec.security.tls_secret:
        ports.append({"name": "health", "containerPort": probe_port, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": COMPONENT,
        "image": r.image or config.image,
        "imagePullPolicy": config.image_pull_policy,
        "args": ["router", "--config", f"{ROUTER_DIR}/{ROUTER_FILE}"],
        "ports": ports,
        "env": env,
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        # ready = a worker answered (the router service's health); alive = the process answers ("")
        "readinessProbe": grpc_probe(probe_port, 5, 3, ROUTER_SERVICE),
        "livenessProbe": grpc_probe(probe_port, 20, 3),
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
                    "annotations": {
                        CONFIG_HASH_ANNOTATION: config_hash(router_settings(instance, namespace, spec)),
                        # Prometheus' kubernetes-pods convention: the routers' /metrics carry the fleet's signals
                        # (spec.autoscaling queries them); with API keys a scrape must send one (docs/operator.md)
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(r.http_port),
                        "prometheus.io/path": "/metrics",
                        "prometheus.io/scheme": "https" if spec.security.https else "http",
                    },
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


def _secret_file(volumes: list[dict[str, Any]], mounts: list[dict[str, Any]], name: str, secret: str, key: str,
                 folder: str, file: str) -> None:  # fmt: skip
    items = [{"key": key, "path": file}]
    volumes.append({"name": name, "secret": {"secretName": secret, "defaultMode": 0o400, "items": items}})
    mounts.append({"name": name, "mountPath": folder, "readOnly": True})


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
