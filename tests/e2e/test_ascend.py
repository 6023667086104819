"""The Ascend examples' rank tables end to end (issue 18): the operator renders NPU worker pods, the test writes the
Ascend device plugin's annotation on them (there is no device plugin or NPU here), and inside each pod a stand-in
for the worker (tests/helpers/rankprobe.py: the worker's own rank-table wait) reads the table at the path its
RANK_TABLE_FILE names: complete, listing every pod of its replica, ranks in the spec's ringOrder, with the node
rank and rank 0's address its arguments give. Where the cluster serves LeaderWorkerSets, the two-node replica is one
LWS group (the pod runner plays the LWS controller): the same tables and node ranks, and a group that loses a pod is
recreated whole."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from glm5_operator.kube import Ref
from glm5_operator.ranktable import ANNOTATION

from tests.e2e.conftest import EXAMPLES, NAMESPACE, Cluster, needs_pods

pytestmark = [pytest.mark.asyncio, needs_pods]
DEPLOYMENTS = "glm5.ai/v1alpha1/glm5deployments"
NPU = "huawei.com/Ascend910"


async def _device_plugin_annotation(cluster: Cluster, pod: str) -> None:
    """What the Ascend device plugin writes on a pod it gives eight NPUs to (ids 0-7, one RoCE IP each)."""
    node = int(cluster.runner.pods[pod].node.removeprefix("node-"))
    devices = [{"device_id": str(i), "device_ip": f"192.168.{node}.{10 + i}"} for i in range(8)]
    value = json.dumps({"pod_name": pod, "server_id": f"10.0.0.{node + 1}", "devices": devices})
    patch = {"metadata": {"annotations": {ANNOTATION: value}}}
    await asyncio.to_thread(cluster.kube.patch, Ref("v1", "Pod", NAMESPACE, pod), patch)


def _probe_report(cluster: Cluster, pod: str) -> dict[str, Any] | None:
    """The probe's last report (a pod's log runs on over its predecessors' under the same name)."""
    log = cluster.runner.pods[pod].dir / "worker.log"
    found = [line for line in (log.read_text().splitlines() if log.exists() else [])
             if line.startswith('{"rank_table_file"')]  # fmt: skip
    return dict(json.loads(found[-1])) if found else None


@pytest.mark.pod_runner(nodes=2, devices={NPU: 8}, programs={"worker": ["-m", "tests.helpers.rankprobe"]})
@pytest.mark.parametrize(
    ("example", "replicas", "pods_of_replica"),
    [
        ("ascend.yaml", 2, lambda name, r: [f"{name}-worker-{r}"]),  # 8 NPUs in one pod, a manual ring order
        ("ascend-two-nodes.yaml", 1, lambda name, r: [f"{name}-worker-{r}", f"{name}-worker-node1-{r}"]),
        pytest.param(
            "ascend-two-nodes.yaml",
            1,
            lambda name, r: [f"{name}-lws-{r}", f"{name}-lws-{r}-1"],
            marks=pytest.mark.installed("lws"),
        ),
    ],
    ids=["one-pod-ring-order", "two-pods", "two-pods-leaderworkerset"],
)
async def test_rank_tables_reach_every_rank_in_ring_order(
    cluster: Cluster, tmp_path: Path, example: str, replicas: int, pods_of_replica: Any
) -> None:
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    name, workers, model = doc["metadata"]["name"], doc["spec"]["workers"], doc["spec"]["model"]
    workers["replicas"] = replicas
    if "hostPath" in model:  # a node directory of a real cluster: one of this machine's instead
        (tmp_path / "host-model").mkdir()
        model["hostPath"] = str(tmp_path / "host-model")
    else:
        claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": model["pvcName"]},
                 "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
        (tmp_path / "claim.yaml").write_text(yaml.safe_dump(claim))
        await cluster.kubectl("apply", "-f", str(tmp_path / "claim.yaml"))
    (tmp_path / "example.yaml").write_text(yaml.safe_dump(doc))
    await cluster.kubectl("apply", "-f", str(tmp_path / "example.yaml"))

    replica_pods = [pods_of_replica(name, r) for r in range(replicas)]
    every_pod = [p for pods in replica_pods for p in pods]
    await cluster.until(lambda: all(p in cluster.runner.pods and cluster.runner.pods[p].procs for p in every_pod),
                        60, "the NPU worker pods to run")  # fmt: skip
    ready = await cluster.until(lambda: cluster.condition(DEPLOYMENTS, name, "RankTableReady"), 60,
                                "the RankTableReady condition")  # fmt: skip
    assert ready["status"] == "False" and ready["reason"] == "Initializing"
    for pod in every_pod:
        await _device_plugin_annotation(cluster, pod)
    await cluster.until(lambda: cluster.condition(DEPLOYMENTS, name, "RankTableReady").get("status") == "True", 60,
                        "the rank tables to complete")  # fmt: skip
    reports = await _reports(cluster, every_pod)
    _check_tables(cluster, workers, replica_pods, reports)
    lws = every_pod[0].startswith(f"{name}-lws-")
    if len(replica_pods[0]) > 1:
        assert cluster.get(DEPLOYMENTS, name)["status"]["workerSet"] == ("LeaderWorkerSet" if lws else "StatefulSet")
    if lws:  # a rank's process dies: its whole group comes back, and gets its table again
        before = {p: cluster.runner.pods[p].ip for p in every_pod}
        cluster.runner.kill(every_pod[-1])
        await cluster.until(
            lambda: (
                set(cluster.runner.restarted_groups) >= set(every_pod)
                and all(p in cluster.runner.pods and cluster.runner.pods[p].procs for p in every_pod)
            ),
            60,
            "the group recreated",
        )
        assert all(cluster.runner.pods[p].ip != before[p] for p in every_pod)  # every pod anew, the leader too
        for pod in every_pod:
            await _device_plugin_annotation(cluster, pod)
        fresh = lambda p: (_probe_report(cluster, p) or {}).get("table", {}).get("server_list", [{}])[0].get(  # noqa: E731
            "container_ip") == cluster.runner.pods[every_pod[0]].ip  # fmt: skip
        await cluster.until(lambda: all(fresh(p) for p in every_pod), 60, "the recreated group's reports")
        _check_tables(cluster, workers, replica_pods, await _reports(cluster, every_pod))


async def _reports(cluster: Cluster, pods: list[str]) -> dict[str, dict[str, Any]]:
    return {p: await cluster.until(lambda p=p: _probe_report(cluster, p), 120, f"{p}'s rank table") for p in pods}


def _check_tables(cluster: Cluster, workers: dict[str, Any], replica_pods: list[list[str]],
                  reports: dict[str, dict[str, Any]]) -> None:  # fmt: skip
    """Every pod of replica r: replica-r.json, complete, its pods in node order, ranks in ring order; node ranks
    0.. in the same order, every rank told rank 0's address, which its /etc/hosts maps to the first pod."""
    devices = workers["devicesPerReplica"]
    order = workers.get("ringOrder") or list(range(devices))
    for r, pods in enumerate(replica_pods):
        tables = [reports[p]["table"] for p in pods]
        assert all(reports[p]["rank_table_file"] == f"/etc/glm5/ranktable/replica-{r}.json" for p in pods)
        assert all(t == tables[0] for t in tables)  # every pod of the replica sees the same ring
        table = tables[0]
        assert table["status"] == "completed" and int(table["server_count"]) == len(pods)
        assert [s["container_ip"] for s in table["server_list"]] == [cluster.runner.pods[p].ip for p in pods]
        # device index i (the replica's devices in pod, then device_id order) gets the rank ringOrder gives it
        flat = [(s["container_ip"], d) for s in table["server_list"] for d in s["device"]]
        by_index = sorted(flat, key=lambda x: ([cluster.runner.pods[p].ip for p in pods].index(x[0]),
                                               int(x[1]["device_id"])))  # fmt: skip
        assert [order.index(i) for i in range(devices)] == [int(d["rank_id"]) for _, d in by_index]
        assert [reports[p]["node_rank"] for p in pods] == list(range(len(pods)))
        if len(pods) > 1:
            masters = {reports[p]["master_addr"] for p in pods}
            assert len(masters) == 1, masters
            hosts = (cluster.runner.pods[pods[-1]].dir / "hosts").read_text().splitlines()
            assert f"{cluster.runner.pods[pods[0]].ip} {masters.pop()}" in hosts
