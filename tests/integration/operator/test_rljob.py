"""RLJob end to end: the real kopf operator reconciling against the kmock API emulator."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.operator.conftest import Cluster, eventually

pytestmark = pytest.mark.asyncio

JOB_CHILDREN = [
    ("ConfigMap", "rl-rl"),
    ("Deployment", "rl-gateway"),
    ("Service", "rl-gateway"),
    ("StatefulSet", "rl-trainer"),
]


def _rl(cluster: Cluster) -> dict[str, Any]:
    return dict(json.loads(cluster.obj("ConfigMap", "rl-rl")["data"]["trainer.json"]))


async def test_deployment_ref_waits_for_the_deployment_then_reuses_its_workers(cluster: Cluster) -> None:
    spec = {"policy": {"path": "/models/tiny"}, "rollout": {"deploymentRef": "serve"},
            "trainer": {"taskPreset": "terminal", "devices": 3},
            "dataset": {"uri": "/data/addition.jsonl"}}  # fmt: skip
    await cluster.apply_cr("RLJob", "rl", spec)
    missing = await eventually(lambda: cluster.condition("RLJob", "rl", "RolloutReady"), what="DeploymentNotFound")
    assert missing["reason"] == "DeploymentNotFound" and "default/serve" in missing["message"]
    assert not cluster.exists("Deployment", "rl-gateway")  # nothing applied while the reference is missing

    await cluster.apply_cr("GLM5Deployment", "serve", {"model": {"path": "/models/tiny"}})
    await eventually(lambda: all(cluster.exists(*c) for c in JOB_CHILDREN), what="RLJob children after retry")
    rl = _rl(cluster)
    assert (rl["eps-low"], rl["eps-high"]) == (0.05, 0.25)  # terminal preset
    assert rl["engines"] == "serve-worker.default.svc:50051"
    # three trainer ranks in the trainer pod, a core each on cpu
    assert rl["nproc-per-node"] == 3
    trainer = cluster.obj("StatefulSet", "rl-trainer")["spec"]["template"]["spec"]["containers"][0]
    assert trainer["resources"]["requests"]["cpu"] == "3"
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


async def test_a_trainer_over_two_pods_and_its_fixed_volume_layout(cluster: Cluster) -> None:
    spec = {"policy": {"path": "/models/tiny"}, "rollout": {"deploymentRef": "serve"},
            "trainer": {"nodes": 2, "devices": 2}, "dataset": {"uri": "/data/addition.jsonl"}}  # fmt: skip
    await cluster.apply_cr("GLM5Deployment", "serve", {"model": {"path": "/models/tiny"}})
    await cluster.apply_cr("RLJob", "rl", spec)
    extra = [("Service", "rl-trainer-ranks"), ("PersistentVolumeClaim", "checkpoints-rl-trainer")]
    await eventually(lambda: all(cluster.exists(*c) for c in [*JOB_CHILDREN, *extra]), what="a two-pod trainer")
    assert cluster.obj("StatefulSet", "rl-trainer")["spec"]["replicas"] == 2
    assert (_rl(cluster)["nnodes"], _rl(cluster)["nproc-per-node"]) == (2, 2)
    claim = cluster.obj("PersistentVolumeClaim", "checkpoints-rl-trainer")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and not claim["metadata"].get("ownerReferences")
    # one ready trainer pod of two is not a ready trainer
    await cluster.patch("StatefulSet", "rl-trainer", {"status": {"readyReplicas": 1, "updatedReplicas": 2}}, "status")
    trainer = await eventually(lambda: cluster.condition("RLJob", "rl", "TrainerReady"))
    assert trainer["status"] == "False"
    await cluster.patch("StatefulSet", "rl-trainer", {"status": {"readyReplicas": 2, "updatedReplicas": 2}}, "status")
    await eventually(lambda: cluster.condition("RLJob", "rl", "TrainerReady")["status"] == "True")  # type: ignore[index]

    # back to one pod would move the checkpoints to another claim: refused, nothing changed
    written = cluster.versions("StatefulSet", "rl-trainer")
    await cluster.patch_spec("RLJob", "rl", {"trainer": {"nodes": 1}})
    ready = await eventually(lambda: (c := cluster.condition("RLJob", "rl", "Ready")) and c["reason"] == "InvalidSpec"
                             and c, what="the refused change")  # fmt: skip
    assert "spec.trainer.nodes: 1" in ready["message"] and "new RLJob" in ready["message"]
    assert cluster.versions("StatefulSet", "rl-trainer") == written
    assert cluster.obj("StatefulSet", "rl-trainer")["spec"]["replicas"] == 2


async def test_invalid_rljob_is_reported_and_applies_nothing(cluster: Cluster) -> None:
    spec = {"policy": {"path": "/m"}, "rollout": {}, "trainer": {"taskPreset": "custom"}, "dataset": {"uri": "/d"}}
    await cluster.apply_cr("RLJob", "rl", spec)
    ready = await eventually(lambda: cluster.condition("RLJob", "rl", "Ready"), what="InvalidSpec")
    assert ready["reason"] == "InvalidSpec"
    assert "deploymentRef" in ready["message"] and "epsLow" in ready["message"]
    assert cluster.obj("RLJob", "rl")["status"]["phase"] == "Failed"
    assert not any(cluster.exists(*c) for c in JOB_CHILDREN)


def _trainer_pod(labels: dict[str, str], message: str, exit_code: int = 0) -> dict[str, Any]:
    """The trainer pod as the kubelet reports it after its container ended (restarting under its StatefulSet)."""
    ended = {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                            "message": message}}  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "rl-trainer-0", "namespace": "default", "labels": labels},
        "spec": {"containers": [{"name": "trainer", "image": "x"}]},
        "status": {"containerStatuses": [{"name": "trainer", "ready": False, "restartCount": 1,
                                         "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                         "lastState": ended}]},
    }  # fmt: skip


async def test_a_job_with_steps_succeeds_scales_to_zero_and_resumes_when_raised(cluster: Cluster) -> None:
    spec = {"policy": {"path": "/models/tiny"}, "rollout": {"workers": {"replicas": 2, "accelerator": "cpu"}},
            "trainer": {"steps": 3}, "dataset": {"uri": "/data/addition.jsonl"}}  # fmt: skip
    await cluster.apply_cr("RLJob", "rl", spec)
    await eventually(lambda: all(cluster.exists(*c) for c in [*JOB_CHILDREN, ("StatefulSet", "rl-rollout-worker")]))
    rl = _rl(cluster)
    assert rl["steps"] == 3 and rl["completion-file"] == "/dev/termination-log"
    trainer = cluster.obj("StatefulSet", "rl-trainer")["spec"]["template"]
    assert trainer["spec"]["containers"][0]["terminationMessagePath"] == "/dev/termination-log"
    training = await eventually(lambda: cluster.condition("RLJob", "rl", "Succeeded"), what="Succeeded=False")
    assert training["status"] == "False" and "3 steps" in training["message"]

    # A trainer stopped by SIGTERM also exits 0, but reports nothing: the job is not done.
    labels = trainer["metadata"]["labels"]
    await cluster.create(_trainer_pod(labels, ""))
    await cluster.patch_spec("RLJob", "rl", {"gateway": {"replicas": 1}})  # a reconcile after the pod event
    await eventually(lambda: cluster.obj("RLJob", "rl")["metadata"].get("generation", 1) > 1)
    assert cluster.condition("RLJob", "rl", "Succeeded")["status"] == "False"  # type: ignore[index]
    assert cluster.obj("StatefulSet", "rl-trainer")["spec"]["replicas"] == 1

    # The trainer took its 3 steps: Succeeded, and the job's workloads go to zero (settings and volume stay).
    done = '{"complete": true, "steps": 3, "version": 3}'
    await cluster.patch("Pod", "rl-trainer-0", {"status": _trainer_pod(labels, done)["status"]}, "status")
    succeeded = await eventually(
        lambda: (c := cluster.condition("RLJob", "rl", "Succeeded")) and c["status"] == "True" and c,
        what="Succeeded=True",
    )
    assert succeeded["reason"] == "StepsCompleted"
    status = cluster.obj("RLJob", "rl")["status"]
    assert status["phase"] == "Succeeded" and status["completedSteps"] == 3
    scaled = [("StatefulSet", "rl-trainer"), ("Deployment", "rl-gateway"), ("StatefulSet", "rl-rollout-worker")]
    await eventually(lambda: all(cluster.obj(k, n)["spec"]["replicas"] == 0 for k, n in scaled), what="scaled to 0")
    assert cluster.exists("ConfigMap", "rl-rl")

    # It stays Succeeded once the pod is gone (the StatefulSet at zero removed it).
    await cluster.delete("Pod", "rl-trainer-0")
    await cluster.patch_spec("RLJob", "rl", {"trainer": {"learningRate": 2e-6}})
    await eventually(lambda: _rl(cluster)["learning-rate"] == 2e-6, what="settings applied")
    assert cluster.obj("RLJob", "rl")["status"]["phase"] == "Succeeded"
    assert all(cluster.obj(k, n)["spec"]["replicas"] == 0 for k, n in scaled)

    # Raising the steps resumes the job: back to its replicas, not Succeeded until the trainer reports 5.
    await cluster.patch_spec("RLJob", "rl", {"trainer": {"steps": 5}})
    await eventually(lambda: cluster.obj("StatefulSet", "rl-trainer")["spec"]["replicas"] == 1, what="scaled up")
    assert cluster.obj("StatefulSet", "rl-rollout-worker")["spec"]["replicas"] == 2
    assert _rl(cluster)["steps"] == 5
    resumed = await eventually(lambda: (c := cluster.condition("RLJob", "rl", "Succeeded")) and c["status"] == "False"
                               and c, what="Succeeded=False again")  # fmt: skip
    assert "5 steps" in resumed["message"]
    assert "completedSteps" not in cluster.obj("RLJob", "rl")["status"]


async def test_a_deployment_behind_mutual_tls_is_refused_as_rollout_engines(cluster: Cluster) -> None:
    await cluster.apply_cr("GLM5Deployment", "serve", {"model": {"path": "/models/tiny"},
                                                       "security": {"tlsSecret": "glm5-tls"}})  # fmt: skip
    spec = {"policy": {"path": "/models/tiny"}, "rollout": {"deploymentRef": "serve"}, "dataset": {"uri": "/d"}}
    await cluster.apply_cr("RLJob", "rl", spec)
    ready = await eventually(lambda: cluster.condition("RLJob", "rl", "RolloutReady"), what="TLSNotSupported")
    assert ready["reason"] == "TLSNotSupported" and "mutual TLS" in ready["message"]
    assert not any(cluster.exists(*c) for c in JOB_CHILDREN)
