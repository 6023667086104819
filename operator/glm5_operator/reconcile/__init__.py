"""Reconciliation: parse the spec, apply every child (adopted, create-or-patch), derive status from the
children's live state, keep the HCCL rank tables in step with the worker pods' device annotations. One reconciler
per custom resource (deployment.py, rljob.py) over what both share (shared.py); `Reconciler` is the door kopf's
handlers use.

Blocking (kubernetes client); kopf runs it in its sync-handler thread pool (see handlers.py). Calls for
the same custom resource are serialised with a lock so a child event and a spec update cannot interleave.
"""

from __future__ import annotations

import threading
from typing import Any

from glm5_operator.api import InvalidSpec
from glm5_operator.config import OperatorConfig
from glm5_operator.kube import Kube, Outcome
from glm5_operator.reconcile.deployment import DeploymentReconciler
from glm5_operator.reconcile.rljob import RLJobReconciler
from glm5_operator.reconcile.shared import (
    DEPLOYMENT,
    OWNER_KIND,
    OWNER_NAME,
    RLJOB,
    Adopt,
    WaitingFor,
    _ref,
    owner_of,
)


class Reconciler:
    def __init__(self, kube: Kube, config: OperatorConfig, adopt: Adopt) -> None:
        self.kube = kube
        written: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.kinds: dict[str, DeploymentReconciler | RLJobReconciler] = {
            DEPLOYMENT: DeploymentReconciler(kube, config, adopt, written),
            RLJOB: RLJobReconciler(kube, config, adopt, written),
        }
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((kind, namespace, name), threading.Lock())

    # -- entry points ---------------------------------------------------------------------------------

    def reconcile(self, body: dict[str, Any], new: bool = False) -> dict[str, Outcome]:
        """Apply every child of a GLM5Deployment or RLJob; raises InvalidSpec (after setting the status) or
        WaitingFor. `new`: the resource was just created, so its children most likely do not exist yet.
        Returns what happened to each child, keyed `Kind/name`."""
        kind, ns, name = body["kind"], body["metadata"]["namespace"], body["metadata"]["name"]
        with self._lock(kind, ns, name):
            return self.kinds[kind].reconcile(body, new)

    def refresh(self, kind: str, namespace: str, name: str, recreate: bool = False) -> None:
        """Re-derive a resource's status from its children (and re-apply them when `recreate`): the
        reaction to a child's event."""
        with self._lock(kind, namespace, name):
            body = self.kube.get(_ref(kind, namespace, name))
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            body.setdefault("kind", kind)
            try:
                self.kinds[kind].refresh(body, recreate)
            except (InvalidSpec, WaitingFor):
                return  # the resource's own handler reports these


__all__ = ["OWNER_KIND", "OWNER_NAME", "Reconciler", "WaitingFor", "owner_of"]
