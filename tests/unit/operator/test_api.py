"""The spec models, the CRDs generated from them, and semantic validation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from glm5_operator.api import InvalidSpec, parse_deployment, parse_rljob
from glm5_operator.api.crds import ALL_CRDS, glm5deployment_crd, rljob_crd

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "glm5"


def test_crd_files_are_generated_from_the_models(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    files = tmp_path / "files"
    subprocess.run([str(ROOT / "scripts" / "gen-crds"), str(tmp_path), str(files)], check=True, env=env)
    for name in ALL_CRDS:
        assert (tmp_path / name).read_text() == (CHART / "crds" / name).read_text(), f"run scripts/gen-crds ({name})"
    rules = "prometheus-adapter-rules.yaml"
    assert (files / rules).read_text() == (CHART / "files" / rules).read_text(), f"run scripts/gen-crds ({rules})"


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for key, child in node.get("properties", {}).items():
        out += _walk(child, f"{path}.{key}")
    if "items" in node:
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


@pytest.mark.parametrize("build", [glm5deployment_crd, rljob_crd])
def test_crds_are_valid_and_structural(build) -> None:
    crd = build()
    kubernetes_validate.validate(crd, "1.33.0", strict=True)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"untyped node {path}"
        assert not ("properties" in node and "additionalProperties" in node), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def _schema_validator(crd: dict[str, Any]) -> jsonschema.Draft4Validator:
    # OpenAPI v3.0 schemas use draft-4 semantics (boolean exclusiveMinimum)
    return jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("example", sorted((CHART / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_examples_pass_the_schema_and_the_semantic_checks(example: Path) -> None:
    docs = list(yaml.safe_load_all(example.read_text()))
    for doc in docs:
        if doc["kind"] not in ("GLM5Deployment", "RLJob"):  # plain Kubernetes objects (the Jobs, claims)
            kubernetes_validate.validate(doc, "1.33.0", strict=True)
        else:
            _check_custom_resource(doc)


def _check_custom_resource(doc: dict[str, Any]) -> None:
    crd, parse = (
        (glm5deployment_crd(), parse_deployment) if doc["kind"] == "GLM5Deployment" else (rljob_crd(), parse_rljob)
    )
    errors = list(_schema_validator(crd).iter_errors(doc))
    assert not errors, [e.message for e in errors]
    spec = parse(doc["spec"])
    assert spec.model_dump(by_alias=True, exclude_unset=True) == doc["spec"]


def test_schema_rejects_what_it_can() -> None:
    validator = _schema_validator(glm5deployment_crd())
    bad = {
        "apiVersion": "glm5.ai/v1alpha1",
        "kind": "GLM5Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "model": {"path": "/m", "dtype": "int4"},
            "workers": {"replicas": -1, "accelerator": "tpu"},
            "kvCache": {"bytes": "lots"},
        },
    }
    messages = " | ".join(e.message for e in validator.iter_errors(bad))
    for expected in ("'int4' is not one of", "-1 is less than the minimum", "'tpu' is not one of", "'lots'"):
        assert expected in messages


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (
            {
                "model": {"path": "/m"},
                "workers": {"accelerator": "ascend-910b", "devicesPerReplica": 4, "ringOrder": [0, 1, 2]},
            },
            "lists 3 ranks",
        ),
        (
            {
                "model": {"path": "/m"},
                "workers": {"accelerator": "ascend-910b", "devicesPerReplica": 3, "ringOrder": [0, 1, 1]},
            },
            "permutation of 0..2",
        ),
        (
            {
                "model": {"path": "/m"},
                "workers": {"accelerator": "nvidia", "devicesPerReplica": 2, "ringOrder": [1, 0]},
            },
            "only applies to accelerator ascend-910b",
        ),
        ({"model": {"path": "/m", "ropeScaling": {"type": "yarn", "factor": 3}}}, "power of two"),
        ({"model": {"path": "/m", "pvcName": "a", "hostPath": "/b"}}, "not both"),
        ({"model": {"path": "/m"}, "workers": {"replicas": "two"}}, "spec.workers.replicas"),
        ({"model": {"path": "/m"}, "surprise": 1}, "spec.surprise: Extra inputs are not permitted"),
        ({"workers": {}}, "spec.model: Field required"),
        (
            {"model": {"path": "/m"}, "router": {"circuitBreaker": {"specAcceptanceDrop": 1}}},
            "spec.router.circuitBreaker.specAcceptanceDrop",
        ),
    ],
)
def test_semantic_problems_are_named(spec: dict, problem: str) -> None:
    with pytest.raises(InvalidSpec) as err:
        parse_deployment(spec)
    assert any(problem in p for p in err.value.problems), err.value.problems


def test_rljob_presets_and_rules() -> None:
    base = {"policy": {"path": "/m"}, "dataset": {"uri": "/data/train.jsonl"}, "rollout": {"deploymentRef": "glm5"}}
    job = parse_rljob(base)
    assert job.trainer.trust_region() == (0.15, 0.35)
    job = parse_rljob({**base, "trainer": {"taskPreset": "terminal", "epsHigh": 0.3}})
    assert job.trainer.trust_region() == (0.05, 0.3)
    for spec, problem in (
        ({**base, "trainer": {"syncIntervalSeconds": 3600}}, "less than or equal to 1800"),
        ({**base, "trainer": {"taskPreset": "custom"}}, "needs epsLow and epsHigh"),
        ({**base, "rollout": {}}, "exactly one of deploymentRef or workers"),
        ({**base, "gateway": {"virtualNodeReserve": 1.5}}, "spec.gateway.virtualNodeReserve"),
    ):
        with pytest.raises(InvalidSpec) as err:
            parse_rljob(spec)
        assert any(problem in p for p in err.value.problems), err.value.problems
