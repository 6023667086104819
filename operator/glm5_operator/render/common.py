"""Names, labels and metadata every child manifest shares."""

from __future__ import annotations

import hashlib
import json
from typing import Any

PART_OF = "glm5"
MANAGED_BY = "glm5-operator"
CONFIG_HASH_ANNOTATION = "glm5.ai/config-hash"
# StatefulSet pods carry controller-revision-hash=<name>-<10 chars>, which must fit a 63-character label value.
MAX_NAME = 52


def child_name(parent: str, suffix: str) -> str:
    """`<parent>-<suffix>`, trimmed with a stable hash so it stays a valid, unique DNS label."""
    name = f"{parent}-{suffix}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:5]
    keep = MAX_NAME - len(suffix) - len(digest) - 2
    return f"{parent[:keep].rstrip('-')}-{digest}-{suffix}"


def selector(instance: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": PART_OF,
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
    }


def labels(instance: str, component: str) -> dict[str, str]:
    return {
        **selector(instance, component),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/part-of": PART_OF,
    }


def metadata(name: str, namespace: str, instance: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(instance, component)}


def config_hash(*parts: Any) -> str:
    """Changes when any rendered configuration changes, so pods that read it roll."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": 1001, "runAsGroup": 1001, "fsGroup": 1001,
            "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip


def container_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def grpc_probe(port: int, period: int, failures: int, service: str | None = None) -> dict[str, Any]:
    grpc: dict[str, Any] = {"port": port}
    if service:
        grpc["service"] = service
    return {"grpc": grpc, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": 5}


def flags_file(settings: dict[str, Any]) -> str:
    """A `--config` file for the glm5 CLI (JSON, which is YAML too): flag names to values, None dropped."""
    return json.dumps({k: v for k, v in settings.items() if v is not None}, indent=2, sort_keys=True) + "\n"
