"""GLM5Deployment end to end: the real kopf operator reconciling against the kmock API emulator."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import yaml
from glm5_operator.ranktable import ANNOTATION

from tests.helpers.kube import OPTIONAL_CRDS
from tests.integration.operator.conftest import Cluster, eventually

pytestmark = pytest.mark.asyncio

CHILDREN = [
    ("ConfigMap", "tiny-engine"),
    ("Service", "tiny-worker"),
    ("StatefulSet", "tiny-worker"),
    ("PodDisruptionBudget", "tiny-worker"),
    ("ConfigMap", "tiny-router-config"),
    ("Deployment", "tiny-router"),
    ("Service", "tiny-router"),
]
SPEC: dict[str, Any] = {
    "model": {"path": "/models/tiny", "servedName": "tiny-chat", "maxModelLen": 4096},
    "workers": {"replicas": 2, "accelerator": "nvidia", "devicesPerReplica": 2},
}


async def _created(cluster: Cluster, name: str = "tiny", spec: dict[str, Any] | None = None) -> None:
    await cluster.apply_cr("GLM5Deployment", name, spec or SPEC)
    await eventually(lambda: all(cluster.exists(k, n.replace("tiny", name)) for k, n in CHILDREN), what="children")
    await eventually(lambda: cluster.condition("GLM5Deployment", name, "Ready"), what="status")


def _engine(cluster: Cluster) -> dict[str, Any]:
    return dict(yaml.safe_load(cluster.obj("ConfigMap", "tiny-engine")["data"]["engine.json"]))


async def test_create_makes_every_child_adopted_labelled_and_configured(cluster: Cluster) -> None:
    await _created(cluster)
    for kind, name in CHILDREN:
        meta = cluster.obj(kind, name)["metadata"]
        (owner,) = meta["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("GLM5Deployment", "tiny", True), name
        assert owner["uid"].startswith("uid-tiny")
        assert meta["labels"]["app.kubernetes.io/instance"] == "tiny"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "glm5-operator"
        assert meta["labels"]["team"] == "ml"  # the owner's labels propagate (kopf.adopt)
    sts = cluster.obj("StatefulSet", "tiny-worker")["spec"]
    assert sts["replicas"] == 2 and sts["serviceName"] == "tiny-worker"
    (container,) = sts["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["args"] == ["worker", "--config", "/etc/glm5/engine/engine.json"]
    assert container["readinessProbe"]["grpc"]["port"] == 50051
    assert "RANK_TABLE_FILE" not in {e["name"] for e in container["env"]}  # Ascend only
    engine = _engine(cluster)
    assert engine["served-model-name"] == "tiny-chat" and engine["max-model-len"] == 4096
    assert engine["device"] == "cuda" and engine["kv-cache-bytes"] == "auto"
    assert cluster.obj("Service", "tiny-worker")["spec"]["clusterIP"] == "None"
    router_cfg = yaml.safe_load(cluster.obj("ConfigMap", "tiny-router-config")["data"]["router.json"])
    assert router_cfg["worker-dns"] == "tiny-worker.default.svc:50051"
    assert router_cfg["token-budget"] == 8192 and router_cfg["breaker-kv-fragmentation"] == 0.65
    ports = {p["name"]: p["port"] for p in cluster.obj("Service", "tiny-router")["spec"]["ports"]}
    assert ports == {"grpc": 50050, "http": 8000}
    status = cluster.obj("GLM5Deployment", "tiny")["status"]
    assert status["endpoints"]["http"] == "http://tiny-router.default.svc:8000/v1"
    assert status["readyReplicas"] == 0 and status["replicas"] == 2
    ready = cluster.condition("GLM5Deployment", "tiny", "Ready")
    assert ready is not None and ready["status"] == "False"  # nothing is ready yet: never optimistic


async def test_restart_and_replays_create_nothing_twice(cluster: Cluster) -> None:
    await _created(cluster)
    before = {c: cluster.versions(*c) for c in CHILDREN}
    for _ in range(2):  # operator restarts: the watch replays ADDED and kopf resumes the resource
        await cluster.stop_operator()
        await cluster.start_operator()
        await eventually(lambda: cluster.condition("GLM5Deployment", "tiny", "Ready"))
    # A touch of the CR that kopf sees (an annotation) replays the reconcile too.
    await cluster.patch("GLM5Deployment", "tiny", {"metadata": {"annotations": {"touched": "yes"}}})
    await asyncio.sleep(2)  # asserting that nothing happens: give the replayed reconcile time to run
    for child in CHILDREN:
        assert cluster.creates(*child) == 1, child
        assert cluster.versions(*child) == before[child], f"{child} was rewritten"


async def test_deleted_child_comes_back(cluster: Cluster) -> None:
    await _created(cluster)
    for kind, name in [("StatefulSet", "tiny-worker"), ("Service", "tiny-router"), ("ConfigMap", "tiny-engine")]:
        await cluster.delete(kind, name)
        await eventually(lambda k=kind, n=name: cluster.exists(k, n), what=f"{kind} {name} recreated")
        assert cluster.obj(kind, name)["metadata"]["ownerReferences"][0]["name"] == "tiny"


async def test_spec_change_patches_only_what_changed(cluster: Cluster) -> None:
    await _created(cluster)
    before = {c: cluster.versions(*c) for c in CHILDREN}
    old_hash = cluster.obj("StatefulSet", "tiny-worker")["spec"]["template"]["metadata"]["annotations"]
    await cluster.patch_spec("GLM5Deployment", "tiny", {"workers": {"replicas": 3}})
    await eventually(lambda: cluster.obj("StatefulSet", "tiny-worker")["spec"]["replicas"] == 3)
    # The replica count is not in the engine config: the pods do not roll, nothing else is written.
    assert cluster.obj("StatefulSet", "tiny-worker")["spec"]["template"]["metadata"]["annotations"] == old_hash
    changed = {c for c in CHILDREN if cluster.versions(*c) != before[c]}
    assert changed == {("StatefulSet", "tiny-worker")}

    before = {c: cluster.versions(*c) for c in CHILDREN}
    await cluster.patch_spec("GLM5Deployment", "tiny", {"sparseAttention": {"denseWarmupTokens": 0}})
    await eventually(lambda: _engine(cluster)["dense-warmup-tokens"] == 0)
    await eventually(
        lambda: cluster.obj("StatefulSet", "tiny-worker")["spec"]["template"]["metadata"]["annotations"] != old_hash,
        what="worker pods roll on an engine config change",
    )
    changed = {c for c in CHILDREN if cluster.versions(*c) != before[c]}
    assert changed == {("ConfigMap", "tiny-engine"), ("StatefulSet", "tiny-worker")}
    cr = lambda: cluster.obj("GLM5Deployment", "tiny")  # noqa: E731
    await eventually(lambda: cr()["status"]["observedGeneration"] == cr()["metadata"]["generation"] == 3)


async def test_removed_field_is_removed_from_the_child(cluster: Cluster) -> None:
    spec = {**SPEC, "workers": {**SPEC["workers"], "nodeSelector": {"pool": "gpu"}}}
    await _created(cluster, spec=spec)
    pod_spec = lambda: cluster.obj("StatefulSet", "tiny-worker")["spec"]["template"]["spec"]  # noqa: E731
    assert pod_spec()["nodeSelector"] == {"pool": "gpu"}
    await cluster.patch_spec("GLM5Deployment", "tiny", {"workers": {"nodeSelector": None}})
    await eventually(lambda: "nodeSelector" not in pod_spec(), what="nodeSelector removed")


async def test_invalid_spec_sets_condition_and_applies_nothing(cluster: Cluster) -> None:
    bad = {"model": {"path": "/m", "ropeScaling": {"type": "yarn", "factor": 3}},
           "workers": {"accelerator": "ascend-910b", "devicesPerReplica": 4, "ringOrder": [0, 1, 1, 3]}}  # fmt: skip
    await cluster.apply_cr("GLM5Deployment", "bad", bad)
    ready = await eventually(lambda: cluster.condition("GLM5Deployment", "bad", "Ready"), what="InvalidSpec")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "power of two" in ready["message"] and "ringOrder" in ready["message"]
    events = await eventually(lambda: cluster.events("InvalidSpec"), what="a Warning Event")
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "bad"
    assert not any(cluster.exists(k, n.replace("tiny", "bad")) for k, n in CHILDREN)


async def test_invalid_update_keeps_the_running_children(cluster: Cluster) -> None:
    await _created(cluster)
    before = {c: cluster.versions(*c) for c in CHILDREN}
    await cluster.patch_spec("GLM5Deployment", "tiny", {"model": {"ropeScaling": {"type": "linear", "factor": 6}}})
    ready = await eventually(
        lambda: (c := cluster.condition("GLM5Deployment", "tiny", "Ready")) and c["reason"] == "InvalidSpec" and c
    )
    assert "factor" in ready["message"]
    assert {c: cluster.versions(*c) for c in CHILDREN} == before


async def test_status_follows_the_children(cluster: Cluster) -> None:
    await _created(cluster)
    sts_status = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    await cluster.patch("StatefulSet", "tiny-worker", {"status": sts_status}, "status")
    workers = await eventually(lambda: (c := cluster.condition("GLM5Deployment", "tiny", "WorkersReady"))
                               and c["status"] == "True" and c)  # fmt: skip
    assert workers["message"].startswith("2/2")
    assert cluster.condition("GLM5Deployment", "tiny", "Ready")["status"] == "False"  # type: ignore[index]
    await cluster.patch(
        "Deployment", "tiny-router", {"status": {"availableReplicas": 1, "updatedReplicas": 1}}, "status"
    )
    await eventually(lambda: cluster.condition("GLM5Deployment", "tiny", "Ready")["status"] == "True")  # type: ignore[index]
    assert cluster.obj("GLM5Deployment", "tiny")["status"]["readyReplicas"] == 2
    assert cluster.condition("GLM5Deployment", "tiny", "Progressing")["status"] == "False"  # type: ignore[index]
    # A worker pod goes away: not ready, degraded, not progressing (no rollout is under way).
    await cluster.patch("StatefulSet", "tiny-worker", {"status": {"readyReplicas": 1}}, "status")
    await eventually(lambda: cluster.condition("GLM5Deployment", "tiny", "Degraded")["status"] == "True")  # type: ignore[index]
    assert cluster.condition("GLM5Deployment", "tiny", "Ready")["status"] == "False"  # type: ignore[index]


ASCEND: dict[str, Any] = {
    "model": {"path": "/models/glm5"},
    "workers": {"replicas": 2, "accelerator": "ascend-910b", "devicesPerReplica": 4, "ringOrder": [0, 2, 3, 1]},
}


def _pod(index: int, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"npu-worker-{index}", "namespace": "default",
                     "labels": {**labels, "apps.kubernetes.io/pod-index": str(index)}},
        "spec": {"containers": [{"name": "worker", "image": "x"}]},
        "status": {"podIP": f"10.0.0.{10 + index}"},
    }  # fmt: skip


def _annotation(index: int, devices: int) -> str:
    devs = [{"device_id": str(d), "device_ip": f"172.16.{index}.{d}"} for d in range(devices)]
    return json.dumps({"pod_name": f"npu-worker-{index}", "server_id": f"192.168.1.{index}", "devices": devs})


async def test_rank_table_flow_in_ring_order(cluster: Cluster) -> None:
    await cluster.apply_cr("GLM5Deployment", "npu", ASCEND)
    await eventually(
        lambda: cluster.exists("ConfigMap", "npu-ranktable") and cluster.exists("StatefulSet", "npu-worker")
    )
    container = cluster.obj("StatefulSet", "npu-worker")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ASCEND_SLOG_PRINT_TO_STDOUT"] == "0" and env["HCCL_ALGO"] == "level0:NA;level1:ring"
    assert "HCCL_RING_ORDER" not in env and "HCCL_ASYNC_ALLREDUCE" not in env  # not CANN variables
    assert env["RANK_TABLE_FILE"] == "/etc/glm5/ranktable/replica-$(POD_INDEX).json"
    assert container["resources"]["limits"]["huawei.com/Ascend910"] == 4
    tables = lambda: {k: json.loads(v) for k, v in cluster.obj("ConfigMap", "npu-ranktable")["data"].items()}  # noqa: E731
    assert {k: t["status"] for k, t in tables().items()} == {
        "replica-0.json": "initializing",
        "replica-1.json": "initializing",
    }

    labels = cluster.obj("StatefulSet", "npu-worker")["spec"]["template"]["metadata"]["labels"]
    for i in range(2):
        await cluster.create(_pod(i, labels))
    await cluster.patch("Pod", "npu-worker-0", {"metadata": {"annotations": {ANNOTATION: _annotation(0, 4)}}})
    await eventually(lambda: tables()["replica-0.json"]["status"] == "completed", what="replica 0 completed")
    # the table and the CR's condition are separate writes: wait for the condition to catch up with the table
    rank = await eventually(lambda: (c := cluster.condition("GLM5Deployment", "npu", "RankTableReady"))
                            and "[1]" in c["message"] and c, what="RankTableReady naming replica 1 only")  # fmt: skip
    assert rank["status"] == "False"  # replica 1 has not reported yet
    table = tables()["replica-0.json"]
    (server,) = table["server_list"]
    assert server["container_ip"] == "10.0.0.10" and server["server_id"] == "192.168.1.0"
    # ringOrder [0, 2, 3, 1]: rank i goes to device ringOrder[i]
    assert [(d["rank_id"], d["device_id"]) for d in server["device"]] == [
        ("0", "0"),
        ("1", "2"),
        ("2", "3"),
        ("3", "1"),
    ]

    # A broken annotation gives a condition message naming the pod, not a crash.
    await cluster.patch("Pod", "npu-worker-1", {"metadata": {"annotations": {ANNOTATION: _annotation(1, 2)}}})
    bad = await eventually(lambda: (c := cluster.condition("GLM5Deployment", "npu", "RankTableReady"))
                           and c["reason"] == "InvalidDeviceAnnotation" and c)  # fmt: skip
    assert "npu-worker-1" in bad["message"]
    await cluster.patch("Pod", "npu-worker-1", {"metadata": {"annotations": {ANNOTATION: _annotation(1, 4)}}})
    await eventually(lambda: cluster.condition("GLM5Deployment", "npu", "RankTableReady")["status"] == "True")  # type: ignore[index]
    assert {t["status"] for t in tables().values()} == {"completed"}
    assert cluster.obj("GLM5Deployment", "npu")["status"]["rankTables"] == {"0": "completed", "1": "completed"}


TWO_NODES: dict[str, Any] = {
    "model": {"path": "/models/glm5"},
    "workers": {"replicas": 1, "accelerator": "ascend-910b", "devicesPerReplica": 4, "devicesPerNode": 2},
}


async def test_replica_over_two_pods_gets_one_rank_table(cluster: Cluster) -> None:
    """Pod 0 of each node's StatefulSet is replica 0: the table lists node 0's devices as ranks 0-1 and node 1's
    as ranks 2-3, the ranks `glm5 worker --node-rank k` runs (k * devicesPerNode + local)."""
    await cluster.apply_cr("GLM5Deployment", "two", TWO_NODES)
    await eventually(lambda: cluster.exists("StatefulSet", "two-worker-node1") and cluster.exists("ConfigMap",
                     "two-ranktable") and cluster.exists("Service", "two-worker-ranks"))  # fmt: skip
    first = cluster.obj("StatefulSet", "two-worker")["spec"]["template"]["metadata"]["labels"]
    second = cluster.obj("StatefulSet", "two-worker-node1")["spec"]["template"]["metadata"]["labels"]
    await cluster.create({**_pod(0, first), "metadata": {**_pod(0, first)["metadata"], "name": "two-worker-0"}})
    node1 = _pod(1, second)
    node1["metadata"].update(name="two-worker-node1-0", labels={**second, "apps.kubernetes.io/pod-index": "0"})
    await cluster.create(node1)
    table = lambda: json.loads(cluster.obj("ConfigMap", "two-ranktable")["data"]["replica-0.json"])  # noqa: E731
    await cluster.patch("Pod", "two-worker-0", {"metadata": {"annotations": {ANNOTATION: _annotation(0, 2)}}})
    await asyncio.sleep(0.3)
    assert table()["status"] == "initializing"  # node 1 has not reported its devices yet
    await cluster.patch("Pod", "two-worker-node1-0", {"metadata": {"annotations": {ANNOTATION: _annotation(1, 2)}}})
    await eventually(lambda: table()["status"] == "completed", what="the two-node table completed")
    servers = table()["server_list"]
    assert [s["container_ip"] for s in servers] == ["10.0.0.10", "10.0.0.11"]
    assert [[d["rank_id"] for d in s["device"]] for s in servers] == [["0", "1"], ["2", "3"]]
    await eventually(lambda: cluster.condition("GLM5Deployment", "two", "RankTableReady")["status"] == "True")  # type: ignore[index]


async def test_autoscaler_follows_the_spec_and_is_deleted_when_it_goes(cluster: Cluster) -> None:
    """backend hpa, then auto on a cluster that serves KEDA (a ScaledObject replaces the HPA), then no autoscaling
    (nothing scales workers.replicas any more); an autoscaler's write to the scale subresource reaches the pods."""
    key, info = OPTIONAL_CRDS["keda"]
    cluster.emulator.resources[key] = info  # what installing KEDA's CRDs does
    auto = {"minReplicas": 1, "maxReplicas": 3, "metric": "inflightTokens", "target": 4096}
    await _created(cluster, spec={**SPEC, "autoscaling": {**auto, "backend": "hpa"}})
    await eventually(lambda: cluster.exists("HorizontalPodAutoscaler", "tiny-autoscaler"), what="the HPA")
    status = lambda: cluster.obj("GLM5Deployment", "tiny")["status"]  # noqa: E731
    await eventually(lambda: status().get("autoscaler") == "HorizontalPodAutoscaler/tiny-autoscaler")
    hpa = cluster.obj("HorizontalPodAutoscaler", "tiny-autoscaler")
    assert hpa["metadata"]["ownerReferences"][0]["name"] == "tiny" and hpa["spec"]["maxReplicas"] == 3

    # what the HPA controller does: PUT the scale subresource; the operator scales the StatefulSet
    await cluster.scale("tiny", 3)
    await eventually(lambda: cluster.obj("StatefulSet", "tiny-worker")["spec"]["replicas"] == 3, what="scaled")

    await cluster.patch_spec("GLM5Deployment", "tiny", {"autoscaling": {"backend": "auto"}})
    await eventually(lambda: cluster.exists("ScaledObject", "tiny-autoscaler"), what="the ScaledObject")
    await eventually(lambda: not cluster.exists("HorizontalPodAutoscaler", "tiny-autoscaler"), what="HPA deleted")
    await eventually(lambda: status()["autoscaler"] == "ScaledObject/tiny-autoscaler", what="status.autoscaler")
    assert "inflight" in cluster.obj("ScaledObject", "tiny-autoscaler")["spec"]["triggers"][0]["metadata"]["query"]

    await cluster.patch_spec("GLM5Deployment", "tiny", {"autoscaling": None})
    await eventually(lambda: not cluster.exists("ScaledObject", "tiny-autoscaler"), what="ScaledObject deleted")
    await eventually(lambda: "autoscaler" not in status(), what="status.autoscaler cleared")
    assert cluster.obj("StatefulSet", "tiny-worker")["spec"]["replicas"] == 3  # the last count stands


async def test_multi_node_mode_is_detected_recorded_and_never_switched_in_place(cluster: Cluster) -> None:
    two_pods = {**SPEC, "workers": {**SPEC["workers"], "devicesPerReplica": 4, "devicesPerNode": 2}}
    # asked for LeaderWorkerSets on a cluster without them: said so, nothing half-made
    explicit = {**two_pods, "workers": {**two_pods["workers"], "multiNode": "leaderWorkerSet"}}
    await cluster.apply_cr("GLM5Deployment", "lws", explicit)
    ready = await eventually(lambda: cluster.condition("GLM5Deployment", "lws", "Ready"), what="a condition")
    assert ready["reason"] == "LeaderWorkerSetNotServed" and "install LWS" in ready["message"]
    assert not cluster.exists("StatefulSet", "lws-worker")

    await _created(cluster, spec=two_pods)  # auto, no LWS: StatefulSets, recorded
    status = lambda: cluster.obj("GLM5Deployment", "tiny")["status"]  # noqa: E731
    await eventually(lambda: status().get("workerSet") == "StatefulSet", what="status.workerSet")
    assert cluster.exists("StatefulSet", "tiny-worker-node1")
    key, info = OPTIONAL_CRDS["lws"]
    cluster.emulator.resources[key] = info  # LWS installed later: auto keeps what runs
    await cluster.patch_spec("GLM5Deployment", "tiny", {"workers": {"maxNumSeqs": 8}})
    await eventually(lambda: _engine(cluster)["max-num-seqs"] == 8, what="the change applied")
    assert not cluster.exists("LeaderWorkerSet", "tiny-lws") and status()["workerSet"] == "StatefulSet"
    await cluster.patch_spec("GLM5Deployment", "tiny", {"workers": {"multiNode": "leaderWorkerSet"}})
    bad = await eventually(lambda: (c := cluster.condition("GLM5Deployment", "tiny", "Ready")) and
                           c["reason"] == "InvalidSpec" and c, what="InvalidSpec")  # fmt: skip
    assert "cannot change in place" in bad["message"] and not cluster.exists("LeaderWorkerSet", "tiny-lws")

    # a new deployment on the cluster that serves them: one LeaderWorkerSet
    await cluster.apply_cr("GLM5Deployment", "fresh", two_pods)
    await eventually(lambda: cluster.exists("LeaderWorkerSet", "fresh-lws"), what="the LeaderWorkerSet")
    await eventually(lambda: cluster.obj("GLM5Deployment", "fresh")["status"].get("workerSet") == "LeaderWorkerSet")
    lws = cluster.obj("LeaderWorkerSet", "fresh-lws")
    assert lws["metadata"]["ownerReferences"][0]["name"] == "fresh"
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    assert leader["glm5.ai/owner-name"] == "fresh"  # its pods map back to the deployment (rank tables)
    assert not cluster.exists("StatefulSet", "fresh-worker")
