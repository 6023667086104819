"""Status from the children's real state: conditions Ready, Progressing, Degraded, WorkersReady, RouterReady,
RankTableReady (Ascend only) and the fields `kubectl get glm5d` and the scale subresource read.

Pure functions over the live objects; nothing here is set optimistically. A condition keeps its
lastTransitionTime while its status does not change (Kubernetes API conventions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Condition = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Rollout:
    """How far one workload (StatefulSet or Deployment) is from its desired replicas."""

    desired: int
    ready: int = 0
    updated: int = 0
    exists: bool = False
    current_generation: bool = False

    @property
    def complete(self) -> bool:
        return self.exists and self.current_generation and self.ready >= self.desired and self.updated >= self.desired

    @property
    def rolling(self) -> bool:
        return self.exists and (not self.current_generation or self.updated < self.desired)

    def describe(self, what: str) -> str:
        if not self.exists:
            return f"{what} not created yet"
        return f"{self.ready}/{self.desired} {what} ready, {self.updated}/{self.desired} updated"


def rollout(obj: dict[str, Any] | None, desired: int, ready_field: str) -> Rollout:
    if obj is None:
        return Rollout(desired)
    st = obj.get("status") or {}
    generation = obj.get("metadata", {}).get("generation")
    observed = st.get("observedGeneration")
    current = generation is None or observed is None or observed >= generation
    # StatefulSets report updatedReplicas, Deployments too; a workload at zero replicas is trivially updated.
    updated = int(st.get("updatedReplicas", 0) or 0) if desired else 0
    return Rollout(desired, int(st.get(ready_field, 0) or 0), updated, True, current)


@dataclass(frozen=True, slots=True)
class RankTables:
    """Per-replica hccl.json status ("initializing" | "completed") and the first problem found, if any."""

    statuses: dict[int, str] = field(default_factory=dict)
    error: str | None = None

    @property
    def completed(self) -> bool:
        return bool(self.statuses) and self.error is None and all(s == "completed" for s in self.statuses.values())


def condition(type_: str, ok: bool, reason: str, message: str, generation: int | None) -> Condition:
    c: Condition = {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def merge_conditions(old: list[Condition] | None, new: list[Condition], now: str) -> list[Condition]:
    """`new` with lastTransitionTime carried over from `old` where the status did not flip; conditions
    of other types in `old` are kept."""
    previous = {c.get("type"): c for c in old or []}
    out: list[Condition] = []
    for c in new:
        before = previous.pop(c["type"], None)
        same = before is not None and before.get("status") == c["status"]
        out.append({**c, "lastTransitionTime": before.get("lastTransitionTime", now) if same and before else now})
    out.extend(previous.values())
    return sorted(out, key=lambda c: str(c.get("type")))


def deployment_conditions(
    generation: int | None,
    workers: Rollout,
    router: Rollout,
    rank_tables: RankTables | None,
) -> list[Condition]:
    """All conditions of a valid GLM5Deployment; `rank_tables` is None off Ascend."""
    conds = [
        condition("WorkersReady", workers.complete, "AllReplicasReady" if workers.complete else "ReplicasNotReady",
                  workers.describe("worker replicas"), generation),
        condition("RouterReady", router.complete, "Available" if router.complete else "NotAvailable",
                  router.describe("router replicas"), generation),
    ]  # fmt: skip
    ready = workers.complete and router.complete
    if rank_tables is not None:
        done = rank_tables.completed
        if rank_tables.error is not None:
            reason, message = "InvalidDeviceAnnotation", rank_tables.error
        elif done:
            reason, message = "Completed", f"hccl.json completed for {len(rank_tables.statuses)} replica(s)"
        else:
            waiting = sorted(r for r, s in rank_tables.statuses.items() if s != "completed")
            reason, message = "Initializing", f"waiting for device annotations of replica(s) {waiting}"
        conds.append(condition("RankTableReady", done, reason, message, generation))
        ready = ready and done
    rolling = workers.rolling or router.rolling or not (workers.exists and router.exists)
    conds.append(condition("Progressing", rolling, "RollingUpdate" if rolling else "Complete",
                           "children are being created or updated" if rolling else "all children are current",
                           generation))  # fmt: skip
    unready = [r.describe(w) for r, w in ((workers, "worker replicas"), (router, "router replicas"))
               if r.exists and not r.rolling and not r.complete]  # fmt: skip
    if unready:
        degraded = condition("Degraded", True, "ReplicasUnavailable", "; ".join(unready), generation)
    elif rank_tables is not None and rank_tables.error is not None:
        degraded = condition("Degraded", True, "RankTableError", rank_tables.error, generation)
    else:
        degraded = condition("Degraded", False, "AsExpected", "all replicas available", generation)
    conds.append(degraded)
    if ready:
        conds.append(condition("Ready", True, "Ready", "workers and router are ready", generation))
    else:
        why = next(
            c
            for c in conds
            if c["type"] in ("WorkersReady", "RouterReady", "RankTableReady") and c["status"] == "False"
        )
        conds.append(
            condition("Ready", False, f"{why['type'].removesuffix('Ready')}NotReady", why["message"], generation)
        )
    return conds


def invalid_spec_conditions(generation: int | None, message: str) -> list[Condition]:
    """Only Ready changes on a bad spec: the other conditions still describe the children, which stay as they were."""
    return [condition("Ready", False, "InvalidSpec", message, generation)]


def is_ready(conditions: list[Condition]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
