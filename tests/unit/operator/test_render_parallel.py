"""Replicas over several devices and several pods: what the operator renders, and that the worker reads it the same
way (flags, node ranks, rank-table rank ids, the Ascend environment)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from glm5_cli.main import parse_args
from glm5_operator.api import parse_deployment
from glm5_operator.api.validation import InvalidSpec
from glm5_operator.config import OperatorConfig
from glm5_operator.ranktable import build_rank_table, parse_annotation
from glm5_operator.render import deployment_children
from glm5_worker.cli import config_from_args
from glm5_worker.config import EngineConfig
from glm5_worker.parallel.replica import npu_index_of_rank, prepare_rank_table, rank_of

CONFIG = OperatorConfig()
NPU = "huawei.com/Ascend910"


def children(workers: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    spec = parse_deployment({"model": {"path": "/models/glm5"}, "workers": workers})
    return {(c.kind, c.name): c.manifest for c in deployment_children("glm5", "ml", spec, CONFIG)}


def container(sts: dict[str, Any]) -> dict[str, Any]:
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return c


def worker_config(cm: dict[str, Any], args: list[str], tmp_path: Path) -> EngineConfig:
    path = tmp_path / "engine.json"
    path.write_text(cm["data"]["engine.json"])
    return config_from_args(parse_args(["worker", "--config", str(path), *args]))


def test_eight_npus_one_pod(tmp_path: Path) -> None:
    kids = children({"accelerator": "ascend-910b", "devicesPerReplica": 8, "replicas": 2})
    stateful_sets = [m for (kind, _), m in kids.items() if kind == "StatefulSet"]
    assert len(stateful_sets) == 1  # one pod per replica holds all 8 devices
    c = container(stateful_sets[0])
    assert c["resources"]["limits"][NPU] == 8 and c["resources"]["requests"][NPU] == 8
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["RANK_TABLE_FILE"] == "/etc/glm5/ranktable/replica-$(POD_INDEX).json" and env["RANK_SIZE"] == "8"
    assert env["HCCL_EXEC_TIMEOUT"] == "120" and env["HCCL_CONNECT_TIMEOUT"] == "1800"
    # only variables CANN documents; no manual ring asked for, so no HCCL_ALGO either
    assert not {"HCCL_RING_ORDER", "HCCL_ASYNC_ALLREDUCE", "HCCL_ALGO"} & env.keys()
    engine = worker_config(kids[("ConfigMap", "glm5-engine")], c["args"][3:], tmp_path)
    assert (engine.tensor_parallel_size, engine.nnodes, engine.node_rank) == (8, 1, 0)
    assert engine.is_expert_parallel and engine.collective_timeout_s == 120 and engine.device == "npu"
    ring = children({"accelerator": "ascend-910b", "devicesPerReplica": 8, "ringOrder": [0, 2, 4, 6, 1, 3, 5, 7]})
    env = {e["name"]: e.get("value") for e in container(ring[("StatefulSet", "glm5-worker")])["env"]}
    assert env["HCCL_ALGO"] == "level0:NA;level1:ring"


def test_sixteen_devices_two_pods_per_replica(tmp_path: Path) -> None:
    kids = children({"accelerator": "ascend-910b", "devicesPerReplica": 16, "devicesPerNode": 8, "replicas": 2})
    for manifest in kids.values():
        kubernetes_validate.validate(manifest, "1.33.0", strict=True)
    first, second = kids[("StatefulSet", "glm5-worker")], kids[("StatefulSet", "glm5-worker-node1")]
    assert first["spec"]["replicas"] == second["spec"]["replicas"] == 2  # pod i of each set: replica i
    for sts in (first, second):
        assert container(sts)["resources"]["limits"][NPU] == 8
    # the other node reaches rank 0 by a per-pod name that exists before rank 0 is ready
    ranks = kids[("Service", "glm5-worker-ranks")]
    assert ranks["spec"]["publishNotReadyAddresses"] is True and ranks["spec"]["clusterIP"] == "None"
    assert first["spec"]["serviceName"] == "glm5-worker-ranks"
    assert kids[("Service", "glm5-worker")]["spec"]["selector"] == first["spec"]["selector"]["matchLabels"]
    assert (
        not second["spec"]["selector"]["matchLabels"].items() <= first["spec"]["template"]["metadata"]["labels"].items()
    )  # the router's Service never selects a follower pod
    cm = kids[("ConfigMap", "glm5-engine")]
    lead = worker_config(cm, container(first)["args"][3:], tmp_path)
    follow = worker_config(cm, container(second)["args"][3:], tmp_path)
    assert (lead.tensor_parallel_size, lead.nnodes, lead.node_rank, lead.master_port) == (16, 2, 0, 29500)
    assert (follow.nnodes, follow.node_rank) == (2, 1)
    assert follow.master_addr == "glm5-worker-$(POD_INDEX).glm5-worker-ranks.ml.svc" == lead.master_addr
    assert "startupProbe" in container(first) and "readinessProbe" not in container(second)
    # HCCL/NCCL/gloo connect a replica's pods on ports of their own choosing: the peers are admitted on all of them
    ingress = kids[("NetworkPolicy", "glm5-workers")]["spec"]["ingress"]
    (peers,) = [r["from"] for r in ingress if "ports" not in r]
    policy = kids[("NetworkPolicy", "glm5-workers")]["spec"]
    pods = [sts["spec"]["template"]["metadata"]["labels"] for sts in (first, second)]
    assert all(_selects(policy["podSelector"], labels) for labels in pods)  # the policy covers the followers too
    assert any(all(_selects(p["podSelector"], labels) for labels in pods) for p in peers)
    assert not _selects(policy["podSelector"], kids[("Deployment", "glm5-router")]["spec"]["template"]["metadata"][
        "labels"])  # fmt: skip
    # rank ids: the table lists pod 0's devices as ranks 0-7 and pod 1's as 8-15; the worker on node k runs
    # ranks k * 8 + local, on the device the table gives each rank
    devices = [parse_annotation(f"p{k}", f"10.0.0.{k}", _annotation(f"192.168.0.{k}", 8), 8) for k in range(2)]
    table = build_rank_table(devices, None)
    for k, config in enumerate((lead, follow)):
        server = table["server_list"][k]
        for local in range(8):
            rank = rank_of(config, local)
            assert rank == k * 8 + local
            assert server["device"][local]["rank_id"] == str(rank)
            assert npu_index_of_rank(table, rank, 16) == local


def test_ring_order_moves_ranks_between_devices() -> None:
    pod = parse_annotation("p0", "10.0.0.1", _annotation("192.168.0.1", 4), 4)
    table = build_rank_table([pod], [0, 2, 3, 1])  # rank i on device ringOrder[i]
    assert [npu_index_of_rank(table, r, 4) for r in range(4)] == [0, 2, 3, 1]
    with pytest.raises(ValueError, match="--tensor-parallel-size is 8"):
        npu_index_of_rank(table, 0, 8)


def test_replica_that_does_not_split_into_pods_is_an_invalid_spec() -> None:
    with pytest.raises(InvalidSpec, match="devicesPerNode: 6 does not divide devicesPerReplica"):
        parse_deployment({"model": {"path": "/m"}, "workers": {"devicesPerReplica": 16, "devicesPerNode": 6}})


def test_worker_waits_for_a_complete_table_and_copies_it_to_a_regular_file(tmp_path: Path) -> None:
    # a ConfigMap volume: the file is a symbolic link into a ..data directory
    data = tmp_path / "..2026_12_01"
    data.mkdir()
    pod = parse_annotation("p0", "10.0.0.1", _annotation("192.168.0.1", 2), 2)
    (data / "replica-0.json").write_text(json.dumps(build_rank_table([pod], None)))
    (tmp_path / "..data").symlink_to(data.name)
    (tmp_path / "replica-0.json").symlink_to("..data/replica-0.json")
    env = {"RANK_TABLE_FILE": str(tmp_path / "replica-0.json")}
    table = prepare_rank_table(5.0, env)
    assert table is not None and table["status"] == "completed"
    copy = Path(env["RANK_TABLE_FILE"])
    assert copy != tmp_path / "replica-0.json" and copy.is_file() and not copy.is_symlink()
    assert json.loads(copy.read_text()) == table
    assert prepare_rank_table(5.0, {}) is None  # no table: HCCL negotiates its own ring
    # a pod that replaced p0 (same name, new address) waits for the operator's new table
    with pytest.raises(ValueError, match=r"completed without this pod \(10.0.0.9\)"):
        prepare_rank_table(0.0, {"RANK_TABLE_FILE": str(tmp_path / "replica-0.json"), "POD_IP": "10.0.0.9"})
    assert prepare_rank_table(0.0, {"RANK_TABLE_FILE": str(tmp_path / "replica-0.json"), "POD_IP": "10.0.0.1"})
    (data / "replica-0.json").write_text(json.dumps(build_rank_table([None], None)))
    with pytest.raises(ValueError, match="still 'initializing'"):
        prepare_rank_table(0.01, {"RANK_TABLE_FILE": str(tmp_path / "replica-0.json")})


def _annotation(server: str, n: int) -> str:
    devices = [{"device_id": str(i), "device_ip": f"172.16.0.{i}"} for i in range(n)]
    return json.dumps({"pod_name": "p", "server_id": server, "devices": devices})


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector's matchLabels and In expressions against a pod's labels, as the API server reads them."""
    if not selector["matchLabels"].items() <= labels.items():
        return False
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions), expressions
    return all(labels.get(e["key"]) in e["values"] for e in expressions)
