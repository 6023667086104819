"""NetworkPolicies and the TLS / API-key wiring a deployment's pods share (docs/security.md).

Workers accept gRPC only from their own deployment's routers and from pods labelled as its clients (the TITO
gateway and trainer of an RLJob that uses the workers); any port from the peers of their collectives: the other
pods of a replica spread over several pods, and the trainer of an RLJob that syncs weights into them by collective
(labelled glm5.ai/syncs-into). Routers accept traffic from `security.routerIngressFrom` (default anyone).
Probes come from the kubelet on the node, which NetworkPolicies do not filter.
"""

from __future__ import annotations

import secrets
from typing import Any

from glm5_operator.api.deployment import GLM5DeploymentSpec
from glm5_operator.render.common import child_name, metadata, selector

CLIENT_OF_LABEL = "glm5.ai/client-of"  # on RLJob pods: the worker instance they call
# on an RLJob trainer that syncs weights by collective: the worker instance whose ranks it sends to (on all ports)
SYNCS_INTO_LABEL = "glm5.ai/syncs-into"
ADMIN_DIR = "/etc/glm5/admin"  # the workers' admin token (UpdateWeights), mounted in workers and RLJob trainers
ADMIN_FILE = "token"
# the instance's internal token: its workers require it on every call but health checks; mounted in the workers, the
# routers and the RLJob gateways and trainers that call them
INTERNAL_DIR = "/etc/glm5/internal"
INTERNAL_FILE = "token"
INTERNAL_TOKEN_FILE = f"{INTERNAL_DIR}/{INTERNAL_FILE}"  # their --internal-token-file
WEIGHTS_ROOT = "/var/lib/glm5/checkpoints"  # where RLJob trainers publish versions; the only place workers load from
TLS_DIR = "/etc/glm5/tls"
API_KEYS_DIR = "/etc/glm5/api-keys"
API_KEYS_FILE = "keys"


def admin_secret_name(instance: str) -> str:
    return child_name(instance, "admin")


def admin_secret(instance: str, namespace: str) -> dict[str, Any]:
    """The workers' admin token: random, created once (never patched, so reconciling keeps it), mounted into
    the instance's workers and into the trainers of the RL jobs that push weights to them."""
    return _token_secret(admin_secret_name(instance), namespace, instance, ADMIN_FILE)


def admin_volume(instance: str) -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {"name": "admin", "secret": {"secretName": admin_secret_name(instance), "defaultMode": 0o400}}
    return volume, {"name": "admin", "mountPath": ADMIN_DIR, "readOnly": True}


def internal_secret_name(instance: str) -> str:
    return child_name(instance, "internal")


def internal_secret(instance: str, namespace: str) -> dict[str, Any]:
    """The instance's internal token, created once like the admin token: every call to its workers carries it
    (`--internal-token-file`), so reaching a worker's port is not enough to use it."""
    return _token_secret(internal_secret_name(instance), namespace, instance, INTERNAL_FILE)


def internal_volume(instance: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The volume and mount of `instance`'s internal token (the workers', or those a client of them calls)."""
    volume = {"name": "internal", "secret": {"secretName": internal_secret_name(instance), "defaultMode": 0o400}}
    return volume, {"name": "internal", "mountPath": INTERNAL_DIR, "readOnly": True}


def _token_secret(name: str, namespace: str, instance: str, key: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(name, namespace, instance, "worker"),
        "type": "Opaque",
        "stringData": {key: secrets.token_urlsafe(32)},
    }


def tls_settings(spec: GLM5DeploymentSpec) -> dict[str, Any]:
    """`glm5 worker` / `glm5 router` TLS flags from a cert-manager style Secret mounted at TLS_DIR."""
    if not spec.security.tls_secret:
        return {}
    return {"tls-cert": f"{TLS_DIR}/tls.crt", "tls-key": f"{TLS_DIR}/tls.key", "tls-ca": f"{TLS_DIR}/ca.crt",
            "health-port": spec.security.health_port}  # fmt: skip


def tls_volume(spec: GLM5DeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if not spec.security.tls_secret:
        return [], []
    volume = {"name": "tls", "secret": {"secretName": spec.security.tls_secret, "defaultMode": 0o400}}
    return [volume], [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}]


def worker_network_policy(instance: str, namespace: str, spec: GLM5DeploymentSpec,
                          components: list[str]) -> dict[str, Any]:  # fmt: skip
    """The workers' policy, over the pods of every node of a replica (`components`: rank 0's and the others')."""
    w = spec.workers
    callers = [
        {"podSelector": {"matchLabels": selector(instance, "router")}},
        {"podSelector": {"matchLabels": {CLIENT_OF_LABEL: instance}}},
    ]
    ingress: list[dict[str, Any]] = [{"from": callers, "ports": [{"protocol": "TCP", "port": w.port}]}]
    # gloo, NCCL and HCCL open their data connections on ports of their own choosing (the rendezvous port only
    # introduces the peers), so the peers of a collective are admitted on every port: a replica's other pods,
    # and an RLJob trainer that sends these workers its weights over a collective
    workers = _components(instance, components)
    collective_peers = [{"podSelector": {"matchLabels": {SYNCS_INTO_LABEL: instance}}}]
    if w.pods_per_replica > 1:
        collective_peers.append({"podSelector": workers})
    ingress.append({"from": collective_peers})
    policy = _policy(child_name(instance, "workers"), namespace, instance, "worker", ingress)
    policy["spec"]["podSelector"] = workers
    return policy


def _components(instance: str, components: list[str]) -> dict[str, Any]:
    """A selector of the instance's pods of any of `components`."""
    base = {k: v for k, v in selector(instance, components[0]).items() if k != "app.kubernetes.io/component"}
    if len(components) == 1:
        return {"matchLabels": selector(instance, components[0])}
    expression = {"key": "app.kubernetes.io/component", "operator": "In", "values": list(components)}
    return {"matchLabels": base, "matchExpressions": [expression]}


def router_network_policy(instance: str, namespace: str, spec: GLM5DeploymentSpec) -> dict[str, Any]:
    r = spec.router
    rule: dict[str, Any] = {
        "ports": [{"protocol": "TCP", "port": r.grpc_port}, {"protocol": "TCP", "port": r.http_port}]
    }
    if spec.security.router_ingress_from is not None:
        rule["from"] = spec.security.router_ingress_from
    return _policy(child_name(instance, "router"), namespace, instance, "router", [rule])


def _policy(name: str, namespace: str, instance: str, component: str, ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(name, namespace, instance, component),
        "spec": {
            "podSelector": {"matchLabels": selector(instance, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
