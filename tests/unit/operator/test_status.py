"""Conditions derived from the children's state (pure functions)."""

from __future__ import annotations

from glm5_operator.status import RankTables, deployment_conditions, merge_conditions, rollout


def _by_type(conds: list[dict[str, object]]) -> dict[object, dict[str, object]]:
    return {c["type"]: c for c in conds}


def _sts(ready: int, updated: int, generation: int = 2, observed: int = 2) -> dict[str, object]:
    return {"metadata": {"generation": generation},
            "status": {"readyReplicas": ready, "updatedReplicas": updated, "observedGeneration": observed}}  # fmt: skip


def test_ready_only_when_every_part_is() -> None:
    workers, router = (
        rollout(_sts(2, 2), 2, "readyReplicas"),
        rollout({"status": {"availableReplicas": 1, "updatedReplicas": 1}}, 1, "availableReplicas"),
    )
    c = _by_type(deployment_conditions(2, workers, router, None))
    assert (
        c["Ready"]["status"] == "True" and c["Progressing"]["status"] == "False" and c["Degraded"]["status"] == "False"
    )
    assert "RankTableReady" not in c  # not Ascend
    c = _by_type(deployment_conditions(2, workers, router, RankTables({0: "completed", 1: "initializing"})))
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "RankTableNotReady"
    assert "[1]" in str(c["RankTableReady"]["message"])


def test_rolling_update_is_progressing_not_degraded() -> None:
    router = rollout({"status": {"availableReplicas": 1, "updatedReplicas": 1}}, 1, "availableReplicas")
    stale = rollout(_sts(2, 2, generation=3, observed=2), 2, "readyReplicas")  # controller has not seen the change
    c = _by_type(deployment_conditions(3, stale, router, None))
    assert (
        c["Progressing"]["status"] == "True" and c["Degraded"]["status"] == "False" and c["Ready"]["status"] == "False"
    )
    half = rollout(_sts(2, 1), 2, "readyReplicas")
    assert _by_type(deployment_conditions(2, half, router, None))["Progressing"]["status"] == "True"
    lost = rollout(_sts(1, 2), 2, "readyReplicas")  # fully updated, one replica down
    c = _by_type(deployment_conditions(2, lost, router, None))
    assert c["Degraded"]["status"] == "True" and c["Progressing"]["status"] == "False"


def test_missing_children_are_not_ready() -> None:
    c = _by_type(
        deployment_conditions(1, rollout(None, 1, "readyReplicas"), rollout(None, 1, "availableReplicas"), None)
    )
    assert c["WorkersReady"]["message"] == "worker replicas not created yet"
    assert c["Ready"]["status"] == "False" and c["Progressing"]["status"] == "True"


def test_transition_time_kept_while_status_holds() -> None:
    old = [{"type": "Ready", "status": "False", "lastTransitionTime": "t0"}, {"type": "Custom", "status": "True"}]
    same = merge_conditions(old, [{"type": "Ready", "status": "False", "reason": "X", "message": ""}], "t1")
    assert _by_type(same)["Ready"]["lastTransitionTime"] == "t0" and "Custom" in _by_type(same)
    flipped = merge_conditions(old, [{"type": "Ready", "status": "True", "reason": "X", "message": ""}], "t1")
    assert _by_type(flipped)["Ready"]["lastTransitionTime"] == "t1"
