"""What the test pod runner (issue 18) makes of Kubernetes objects, as pure functions: the Pods a StatefulSet,
a Deployment or a LeaderWorkerSet controller would create, and how one container of a Pod runs here (argv,
environment, mounts).

The image is ignored: every container runs this checkout's `glm5` (the image's entrypoint runs `glm5 ARGS`).
Environment values follow the kubelet: `value`, `valueFrom` (fieldRef, configMapKeyRef, secretKeyRef), then
`$(VAR)` in later values and in args. Volumes: configMap / secret as files (`items` honoured), emptyDir a fresh
directory, persistentVolumeClaim one directory per claim (shared by the pods that mount it), hostPath itself.
"""

from __future__ import annotations

import base64
import copy
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class PodError(Exception):
    """The pod cannot start as specified (a missing ConfigMap key, an unknown field): its status says why."""


def statefulset_pods(sts: dict[str, Any]) -> list[dict[str, Any]]:
    """Pods `<sts>-<i>` with the pod-index label, hostname and the governing Service as subdomain."""
    name, spec = sts["metadata"]["name"], sts["spec"]
    out = []
    for i in range(int(spec.get("replicas", 1))):
        pod = _from_template(sts, f"{name}-{i}")
        pod["metadata"]["labels"][POD_INDEX_LABEL] = str(i)
        pod["metadata"]["labels"]["statefulset.kubernetes.io/pod-name"] = f"{name}-{i}"
        pod["spec"]["hostname"] = f"{name}-{i}"
        if spec.get("serviceName"):
            pod["spec"]["subdomain"] = spec["serviceName"]
        for claim in spec.get("volumeClaimTemplates") or []:  # the controller's per-pod claims
            volume = {
                "name": claim["metadata"]["name"],
                "persistentVolumeClaim": {"claimName": claim_name(sts, claim, i)},
            }
            pod["spec"].setdefault("volumes", []).append(volume)
        out.append(pod)
    return out


LWS_NAME, LWS_GROUP, LWS_WORKER, LWS_KEY = (f"leaderworkerset.sigs.k8s.io/{k}" for k in
                                           ("name", "group-index", "worker-index", "group-key"))  # fmt: skip


def leader_worker_set_pods(lws: dict[str, Any]) -> list[dict[str, Any]]:
    """What the LeaderWorkerSet controller creates per group g: the leader `<lws>-<g>` (worker index 0) from the
    leader template and workers `<lws>-<g>-<i>` from the worker template, labelled with the set, group, index and
    group key, named in the set's headless Service `<lws>` (subdomain policy Shared), with LWS_LEADER_ADDRESS,
    LWS_GROUP_SIZE and LWS_WORKER_INDEX in every container."""
    name, ns, spec = lws["metadata"]["name"], lws["metadata"]["namespace"], lws["spec"]
    group = spec["leaderWorkerTemplate"]
    size = int(group.get("size", 1))
    out = []
    for g in range(int(spec.get("replicas", 1))):
        for i in range(size):
            template = group.get("leaderTemplate") if i == 0 else None
            pod_name = f"{name}-{g}" if i == 0 else f"{name}-{g}-{i}"
            pod = _from_template(lws, pod_name, template or group["workerTemplate"])
            pod["metadata"]["labels"] |= {LWS_NAME: name, LWS_GROUP: str(g), LWS_WORKER: str(i),
                                          LWS_KEY: f"{name}-{g}"}  # fmt: skip
            pod["spec"]["hostname"], pod["spec"]["subdomain"] = pod_name, name
            env = [
                {"name": "LWS_LEADER_ADDRESS", "value": f"{name}-{g}.{name}.{ns}"},
                {"name": "LWS_GROUP_SIZE", "value": str(size)},
                {"name": "LWS_WORKER_INDEX", "value": str(i)},
            ]
            for container in pod["spec"]["containers"]:
                container["env"] = env + list(container.get("env") or [])  # first: later values may use them
            out.append(pod)
    return out


def leader_worker_set_service(lws: dict[str, Any]) -> dict[str, Any]:
    """The headless Service the controller makes for a set's pods (published before they are ready)."""
    name, ns = lws["metadata"]["name"], lws["metadata"]["namespace"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {LWS_NAME: name}}}  # fmt: skip


def claim_name(sts: dict[str, Any], template: dict[str, Any], index: int) -> str:
    return f"{template['metadata']['name']}-{sts['metadata']['name']}-{index}"


def statefulset_claims(sts: dict[str, Any]) -> list[dict[str, Any]]:
    """The PersistentVolumeClaims a StatefulSet controller creates from volumeClaimTemplates (kept on scale-down)."""
    out = []
    for i in range(int(sts["spec"].get("replicas", 1))):
        for template in sts["spec"].get("volumeClaimTemplates") or []:
            out.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                        "metadata": {"name": claim_name(sts, template, i), "namespace": sts["metadata"]["namespace"]},
                        "spec": template["spec"]})  # fmt: skip
    return out


def job_pods(job: dict[str, Any]) -> list[dict[str, Any]]:
    """A Job's one pod (parallelism and completions of 1, which is all the chart's examples use)."""
    spec = job["spec"]
    if int(spec.get("parallelism", 1)) != 1 or int(spec.get("completions", 1)) != 1:
        raise PodError("the test pod runner runs Jobs of one pod")
    pod = _from_template(job, f"{job['metadata']['name']}-0")
    pod["metadata"]["labels"]["job-name"] = job["metadata"]["name"]
    return [pod]


def deployment_pods(dep: dict[str, Any]) -> list[dict[str, Any]]:
    name, spec = dep["metadata"]["name"], dep["spec"]
    return [_from_template(dep, f"{name}-{i}") for i in range(int(spec.get("replicas", 1)))]


def _from_template(owner: dict[str, Any], name: str, template: dict[str, Any] | None = None) -> dict[str, Any]:
    template = copy.deepcopy(template if template is not None else owner["spec"]["template"])
    meta = template.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": owner["metadata"]["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
            "ownerReferences": [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": owner["metadata"]["name"],
                    "uid": owner["metadata"].get("uid", ""),
                    "controller": True,
                }
            ],
        },
        "spec": template["spec"],
    }


@dataclass
class Launch:
    """How one container runs here."""

    argv: list[str]
    env: dict[str, str]
    mounts: list[dict[str, Any]] = field(default_factory=list)  # tests.helpers.podns mounts


@dataclass
class Objects:
    """What a pod may read from the API: ConfigMaps and Secrets by name (its namespace)."""

    config_maps: dict[str, dict[str, Any]] = field(default_factory=dict)
    secrets: dict[str, dict[str, Any]] = field(default_factory=dict)

    def config_map_data(self, name: str) -> dict[str, str]:
        if name not in self.config_maps:
            raise PodError(f"configmap {name!r} not found")
        return dict(self.config_maps[name].get("data") or {})

    def secret_data(self, name: str) -> dict[str, str]:
        if name not in self.secrets:
            raise PodError(f"secret {name!r} not found")
        secret = self.secrets[name]
        out = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        out.update(secret.get("stringData") or {})
        return out


def field_value(pod: dict[str, Any], path: str, pod_ip: str) -> str:
    """The downward API fields the chart's pods use."""
    meta = pod["metadata"]
    if path == "metadata.name":
        return str(meta["name"])
    if path == "metadata.namespace":
        return str(meta["namespace"])
    if path == "status.podIP":
        return pod_ip
    label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    if label:
        return str(meta.get("labels", {}).get(label.group(1), ""))
    raise PodError(f"fieldRef {path!r} is not supported by the test pod runner")


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)`: replaced when VAR is defined, left as it is otherwise."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(pod: dict[str, Any], container: dict[str, Any], objects: Objects, pod_ip: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
            continue
        source = item.get("valueFrom") or {}
        if "fieldRef" in source:
            env[item["name"]] = field_value(pod, source["fieldRef"]["fieldPath"], pod_ip)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[item["name"]] = _key(objects.config_map_data(ref["name"]), ref, "configmap")
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[item["name"]] = _key(objects.secret_data(ref["name"]), ref, "secret")
        else:
            raise PodError(f"env {item['name']}: unsupported valueFrom {sorted(source)}")
    return env


def _key(data: dict[str, str], ref: dict[str, Any], kind: str) -> str:
    if ref["key"] not in data:
        raise PodError(f"{kind} {ref['name']!r} has no key {ref['key']!r}")
    return data[ref["key"]]


def write_volumes(pod: dict[str, Any], objects: Objects, pod_dir: Path, claims_dir: Path,
                  only_projected: bool = False) -> dict[str, Path]:  # fmt: skip
    """Each volume of the pod as a directory (or file) here: name -> path. `only_projected`: (re)write just the
    ConfigMap and Secret volumes, each changed file replaced atomically."""
    out: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        if only_projected and "configMap" not in volume and "secret" not in volume:
            continue
        if "configMap" in volume or "secret" in volume:
            if "configMap" in volume:
                data = objects.config_map_data(volume["configMap"]["name"])
                items = volume["configMap"].get("items")
            else:
                data = objects.secret_data(volume["secret"]["secretName"])
                items = volume["secret"].get("items")
            folder = pod_dir / "volumes" / name
            folder.mkdir(parents=True, exist_ok=True)
            for key, path in [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]:
                if key not in data:
                    raise PodError(f"volume {name}: no key {key!r}")
                target = folder / path
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists() or target.read_text() != data[key]:
                    staged = target.with_name(f".{target.name}.new")
                    staged.write_text(data[key])
                    staged.replace(target)  # the pod sees the folder (a bind mount), so the new file too
            out[name] = folder
        elif "emptyDir" in volume:
            out[name] = pod_dir / "volumes" / name
            out[name].mkdir(parents=True, exist_ok=True)
        elif "persistentVolumeClaim" in volume:
            out[name] = claims_dir / volume["persistentVolumeClaim"]["claimName"]
            out[name].mkdir(parents=True, exist_ok=True)
        elif "hostPath" in volume:
            out[name] = Path(volume["hostPath"]["path"])
        else:
            raise PodError(f"volume {name}: unsupported kind {sorted(k for k in volume if k != 'name')}")
    return out


def launch(pod: dict[str, Any], container: dict[str, Any], objects: Objects, volumes: dict[str, Path],
           pod_ip: str) -> Launch:  # fmt: skip
    env = container_env(pod, container, objects, pod_ip)
    args = [expand(str(a), env) for a in container.get("args") or []]
    command = [expand(str(c), env) for c in container.get("command") or []]
    if command[:1] == ["glm5"]:
        command = [sys.executable, "-m", "glm5_cli", *command[1:]]  # the image's glm5 is this checkout's
    argv = command + args if command else [sys.executable, "-m", "glm5_cli", *args]  # the image's entrypoint
    mounts = []
    for m in container.get("volumeMounts") or []:
        if m["name"] not in volumes:
            raise PodError(f"volumeMount {m['name']!r} names no volume of the pod")
        source = volumes[m["name"]] / m["subPath"] if m.get("subPath") else volumes[m["name"]]
        mounts.append({"source": str(source), "target": m["mountPath"], "read_only": bool(m.get("readOnly")),
                       "file": source.is_file()})  # fmt: skip
    return Launch(argv, env, mounts)
