"""workers.multiNode: a replica over several pods rendered as a LeaderWorkerSet group, checked against the LWS CRD
(vendored in tests/data/crds): the leader is rank 0 and serves, the workers get their node rank and rank 0's address
from LWS's own variables, the group index is the replica (its rank table), and the policies cover both."""

from __future__ import annotations

from typing import Any

import jsonschema
from glm5_operator.api import parse_deployment
from glm5_operator.config import OperatorConfig
from glm5_operator.render import deployment_children

from tests.helpers.crdschema import crd_schema

SPEC = {"model": {"path": "/m"}, "workers": {"replicas": 3, "devicesPerReplica": 16, "devicesPerNode": 8,
                                             "accelerator": "ascend-910b"}}  # fmt: skip


def _children(lws: bool, spec: dict[str, Any] = SPEC) -> dict[tuple[str, str], dict[str, Any]]:
    out = deployment_children("g", "prod", parse_deployment(spec), OperatorConfig(), lws=lws)
    return {(c.kind, c.name): c.manifest for c in out}


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_multi_pod_replica_is_one_group_of_a_valid_leaderworkerset() -> None:
    children = _children(lws=True)
    lws = children[("LeaderWorkerSet", "g-lws")]
    jsonschema.validate(lws, crd_schema("leaderworkerset.x-k8s.io_leaderworkersets.yaml.gz", "v1"))
    assert not [k for k in children if k[0] == "StatefulSet"] and ("Service", "g-worker-ranks") not in children
    group = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["replicas"] == 3 and group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (worker,) = group["workerTemplate"]["spec"]["containers"]
    assert leader["args"][-2:] == ["--master-addr", "$(LWS_LEADER_ADDRESS)"] and "--node-rank" not in leader["args"]
    assert worker["args"][-4:] == ["--master-addr", "$(LWS_LEADER_ADDRESS)", "--node-rank", "$(LWS_WORKER_INDEX)"]
    assert "readinessProbe" in leader and "readinessProbe" not in worker and "ports" not in worker
    for c in (leader, worker):  # the group is the replica: its rank table, as the StatefulSet ordinal was
        env = _env(c)
        assert env["POD_INDEX"] == {
            "fieldRef": {"fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"}
        }
        assert env["RANK_TABLE_FILE"] == "/etc/glm5/ranktable/replica-$(POD_INDEX).json" and "POD_IP" in env
    components = [t["metadata"]["labels"]["app.kubernetes.io/component"]
                  for t in (group["leaderTemplate"], group["workerTemplate"])]  # fmt: skip
    assert components == ["worker", "worker-node"]
    # the router's Service finds the leaders only; the policy admits both kinds of pod
    assert children[("Service", "g-worker")]["spec"]["selector"]["app.kubernetes.io/component"] == "worker"
    policy = children[("NetworkPolicy", "g-workers")]
    assert {"key": "app.kubernetes.io/component", "operator": "In", "values": components} in (
        policy["spec"]["podSelector"]["matchExpressions"])  # fmt: skip


def test_statefulsets_stay_the_fallback_and_one_pod_replicas_never_use_lws() -> None:
    sts = _children(lws=False)
    assert ("StatefulSet", "g-worker") in sts and ("StatefulSet", "g-worker-node1") in sts
    assert not [k for k in sts if k[0] == "LeaderWorkerSet"]
    (node1,) = sts[("StatefulSet", "g-worker-node1")]["spec"]["template"]["spec"]["containers"]
    assert node1["args"][-2:] == ["--node-rank", "1"]
    one_pod = _children(lws=True, spec={"model": {"path": "/m"}, "workers": {"devicesPerReplica": 8}})
    assert ("StatefulSet", "g-worker") in one_pod and not [k for k in one_pod if k[0] == "LeaderWorkerSet"]
