"""The test pod runner's reading of the operator's manifests (tests/helpers/podspec.py): the pods the controllers
would make, and each container's argv, environment and mounts, from what the operator really renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from glm5_operator.api import parse_deployment
from glm5_operator.config import OperatorConfig
from glm5_operator.render import deployment_children

from tests.helpers.podspec import (
    POD_INDEX_LABEL,
    Objects,
    PodError,
    deployment_pods,
    expand,
    launch,
    statefulset_pods,
    write_volumes,
)

CHART = Path(__file__).resolve().parents[2] / "charts" / "glm5"


def _children() -> dict[tuple[str, str], dict]:  # type: ignore[type-arg]
    doc = yaml.safe_load((CHART / "examples" / "cpu.yaml").read_text())
    spec = parse_deployment(doc["spec"])
    return {(c.kind, c.name): c.manifest for c in deployment_children("tiny", "default", spec, OperatorConfig())}


def test_controllers_expand_into_named_indexed_pods() -> None:
    children = _children()
    sts = children["StatefulSet", "tiny-worker"]
    sts["spec"]["replicas"] = 2
    pods = statefulset_pods(sts)
    assert [p["metadata"]["name"] for p in pods] == ["tiny-worker-0", "tiny-worker-1"]
    assert pods[1]["metadata"]["labels"][POD_INDEX_LABEL] == "1"
    assert pods[1]["spec"]["hostname"] == "tiny-worker-1" and pods[1]["spec"]["subdomain"] == "tiny-worker"
    assert pods[0]["metadata"]["ownerReferences"][0]["kind"] == "StatefulSet"
    (router,) = deployment_pods(children["Deployment", "tiny-router"])
    assert router["metadata"]["labels"]["app.kubernetes.io/component"] == "router"


def test_a_worker_container_runs_glm5_with_its_volumes_and_downward_env(tmp_path: Path) -> None:
    children = _children()
    (pod,) = statefulset_pods(children["StatefulSet", "tiny-worker"])
    objects = Objects(config_maps={"tiny-engine": children["ConfigMap", "tiny-engine"]},
                      secrets={name: children["Secret", name] for name in ("tiny-admin", "tiny-internal")})  # fmt: skip
    volumes = write_volumes(pod, objects, tmp_path / "pod", tmp_path / "claims")
    assert json.loads((volumes["engine"] / "engine.json").read_text())["port"] == 50051
    assert (volumes["admin"] / "token").read_text() == children["Secret", "tiny-admin"]["stringData"]["token"]
    internal = children["Secret", "tiny-internal"]["stringData"]["token"]
    assert (volumes["internal"] / "token").read_text() == internal
    assert volumes["model"] == tmp_path / "claims" / "glm5-models"  # one directory per claim, shared
    container = pod["spec"]["containers"][0]
    run = launch(pod, container, objects, volumes, "127.0.0.7")
    assert run.argv[1:4] == ["-m", "glm5_cli", "worker"] and run.argv[-2:] == [
        "--config",
        "/etc/glm5/engine/engine.json",
    ]
    assert run.env["POD_NAME"] == "tiny-worker-0" and run.env["POD_INDEX"] == "0"
    targets = {m["target"]: m for m in run.mounts}
    assert targets["/etc/glm5/engine"]["read_only"] and targets["/models/glm5-tiny"]["source"] == str(volumes["model"])


def test_env_expansion_and_missing_objects() -> None:
    assert expand("replica-$(POD_INDEX).json $(UNSET)", {"POD_INDEX": "3"}) == "replica-3.json $(UNSET)"
    pod = {"metadata": {"name": "p", "namespace": "ns", "labels": {}}, "spec": {"volumes": []}}
    container = {"env": [{"name": "URL", "valueFrom": {"secretKeyRef": {"name": "redis", "key": "url"}}}]}
    with pytest.raises(PodError, match="secret 'redis' not found"):
        launch(pod, container, Objects(), {}, "127.0.0.2")
    secret = {"data": {"url": "cmVkaXM6Ly94"}}  # base64 of redis://x
    assert launch(pod, container, Objects(secrets={"redis": secret}), {}, "127.0.0.2").env["URL"] == "redis://x"
