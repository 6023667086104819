"""RLJob end to end: the real kopf operator reconciling against the kmock API emulator."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.integration.operator.conftest import Cluster, eventually

pytestmark = pytest.mark.asyncio

JOB_CHILDREN = [
    ("ConfigMap", "rl-rl"),
    ("Deployment", "rl-gateway"),
    ("Service", "rl-gateway"),
    ("StatefulSet", "rl-trainer"),
]


def _rl(cluster: Cluster) -> dict[str, Any]:
    return dict(yaml.safe_load(cluster.obj("ConfigMap", "rl-rl")["data"]["trainer.json"]))


async def test_deployment_ref_waits_for_the_deployment_then_reuses_its_workers(cluster: Cluster) -> None:
    spec = {"policy": {"path": "/models/tiny"}, "rollout": {"deploymentRef": "serve"},
            "trainer": {"taskPreset": "terminal"}, "dataset": {"uri": "/data/addition.jsonl"}}  # fmt: skip
    await cluster.apply_cr("RLJob", "rl", spec)
    missing = await eventually(lambda: cluster.condition("RLJob", "rl", "RolloutReady"), what="DeploymentNotFound")
    assert missing["reason"] == "DeploymentNotFound" and "default/serve" in missing["message"]
    assert not cluster.exists("Deployment", "rl-gateway")  # nothing applied while the reference is missing

    await cluster.apply_cr("GLM5Deployment", "serve", {"model": {"path": "/models/tiny"}})
    await eventually(lambda: all(cluster.exists(*c) for c in JOB_CHILDREN), what="RLJob children after retry")
    rl = _rl(cluster)
    assert (rl["eps-low"], rl["eps-high"]) == (0.05, 0.25)  # terminal preset
    assert rl["engines"] == "serve-worker.default.svc:50051"
    assert not cluster.exists("StatefulSet", "rl-rollout-worker")  # reuses the deployment's workers
    for kind, name in JOB_CHILDREN:
        assert cluster.obj(kind, name)["metadata"]["ownerReferences"][0]["kind"] == "RLJob"
    status = await eventually(lambda: cluster.obj("RLJob", "rl")["status"].get("trustRegion"))
    assert status == {"epsLow": 0.05, "epsHigh": 0.25}


async def test_own_rollout_workers_and_explicit_trust_region(cluster: Cluster) -> None:
    spec = {"policy": {"path": "/models/tiny"},
            "rollout": {"workers": {"replicas": 3, "accelerator": "cpu"}},
            "trainer": {"taskPreset": "math", "epsHigh": 0.3, "syncIntervalSeconds": 900},
            "dataset": {"uri": "/data/addition.jsonl"}}  # fmt: skip
    await cluster.apply_cr("RLJob", "rl", spec)
    await eventually(lambda: all(cluster.exists(*c) for c in [*JOB_CHILDREN, ("StatefulSet", "rl-rollout-worker")]))
    assert cluster.obj("StatefulSet", "rl-rollout-worker")["spec"]["replicas"] == 3
    rl = _rl(cluster)
    assert (rl["eps-low"], rl["eps-high"]) == (0.15, 0.3)  # math preset, eps_high overridden
    assert rl["sync-interval-seconds"] == 900 and rl["engines"] == "rl-rollout-worker.default.svc:50051"
    # Status is derived from the children: the gateway becoming available flips only its condition.
    await cluster.patch(
        "Deployment", "rl-gateway", {"status": {"availableReplicas": 1, "updatedReplicas": 1}}, "status"
    )
    await eventually(lambda: cluster.condition("RLJob", "rl", "GatewayReady")["status"] == "True")  # type: ignore[index]
    assert cluster.condition("RLJob", "rl", "Ready")["status"] == "False"  # type: ignore[index]
    assert cluster.obj("RLJob", "rl")["status"]["phase"] == "Pending"


async def test_invalid_rljob_is_reported_and_applies_nothing(cluster: Cluster) -> None:
    spec = {"policy": {"path": "/m"}, "rollout": {}, "trainer": {"taskPreset": "custom"}, "dataset": {"uri": "/d"}}
    await cluster.apply_cr("RLJob", "rl", spec)
    ready = await eventually(lambda: cluster.condition("RLJob", "rl", "Ready"), what="InvalidSpec")
    assert ready["reason"] == "InvalidSpec"
    assert "deploymentRef" in ready["message"] and "epsLow" in ready["message"]
    assert cluster.obj("RLJob", "rl")["status"]["phase"] == "Failed"
    assert not any(cluster.exists(*c) for c in JOB_CHILDREN)
