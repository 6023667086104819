"""CustomResourceDefinitions generated from the spec models (the one source of truth for the schema).

pydantic emits JSON Schema; Kubernetes wants a structural OpenAPI v3 schema: no $ref, no titles, `nullable`
instead of `anyOf [X, null]`, boolean `exclusiveMinimum`, free-form objects marked to preserve unknown
fields. `scripts/gen-crds` writes these into charts/glm5/crds/; a test fails when the files are stale.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from glm5_operator.api.base import GROUP, VERSION
from glm5_operator.api.deployment import GLM5DeploymentSpec
from glm5_operator.api.rljob import RLJobSpec

_CONDITION = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string"},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"},
    },
}


def structural(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _convert(raw, defs)


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").split("/")[-1]]
        node = {**target, **{k: v for k, v in node.items() if k in ("description",)}}
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        variants = [v for v in any_of if v.get("type") != "null"]
        assert len(variants) == 1, f"only Optional[X] unions are supported, got {any_of}"
        merged = _convert(variants[0], defs)
        merged.update({k: v for k, v in node.items() if k == "description"})
        merged["nullable"] = True
        return merged
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title",) or (key == "default" and (value is None or isinstance(value, dict | list))):
            continue
        if key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "properties":
            out["properties"] = {k: _convert(v, defs) for k, v in value.items()}
        elif key == "items":
            out["items"] = _convert(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict) and value:
                out["additionalProperties"] = _convert(value, defs)
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _crd(
    kind: str,
    plural: str,
    short: str,
    description: str,
    spec: type[BaseModel],
    columns: list[dict[str, Any]],
    scale: bool,
) -> dict[str, Any]:
    status = {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {
            "observedGeneration": {"type": "integer"},
            "conditions": {"type": "array", "items": _CONDITION},
        },
    }
    version: dict[str, Any] = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {
            "openAPIV3Schema": {
                "type": "object",
                "description": description,
                "required": ["spec"],
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "metadata": {"type": "object"},
                    "spec": structural(spec),
                    "status": status,
                },
            }
        },
        "subresources": {"status": {}},
        "additionalPrinterColumns": columns,
    }
    if scale:
        # the API server then fills workers.replicas (its own default) in a spec that leaves workers out: a GET of
        # /scale fails while specReplicasPath holds nothing, which stops an HPA and `kubectl scale`
        version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["workers"]["default"] = {}
        version["subresources"]["scale"] = {
            "specReplicasPath": ".spec.workers.replicas",
            "statusReplicasPath": ".status.readyReplicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": [short],
                "listKind": f"{kind}List",
            },
            "versions": [version],
        },
    }


def glm5deployment_crd() -> dict[str, Any]:
    columns = [  # READY as `kubectl get deploy` shows it: ready/desired model replicas
        {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
        {"name": "Status", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.servedName"},
        {"name": "Accelerator", "type": "string", "jsonPath": ".spec.workers.accelerator"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    description = "A served GLM-5-family model: workers, router, services and configuration."
    return _crd("GLM5Deployment", "glm5deployments", "glm5d", description, GLM5DeploymentSpec, columns, scale=True)


def rljob_crd() -> dict[str, Any]:
    columns: list[dict[str, Any]] = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Steps", "type": "integer", "jsonPath": ".status.trainedSteps"},
        {"name": "Target", "type": "integer", "jsonPath": ".spec.trainer.steps"},
        {"name": "Policy-Version", "type": "integer", "jsonPath": ".status.policyVersion"},
        {"name": "Last-Sync", "type": "date", "jsonPath": ".status.lastSyncTime"},
        {"name": "Checkpoint", "type": "string", "jsonPath": ".status.checkpoint.claim", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    description = "Asynchronous RL: TITO gateway, rollout engines and a trainer that pushes weights back."
    return _crd("RLJob", "rljobs", "rlj", description, RLJobSpec, columns, scale=False)


ALL_CRDS = {"glm5deployments.glm5.ai.yaml": glm5deployment_crd, "rljobs.glm5.ai.yaml": rljob_crd}
