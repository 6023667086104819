"""kopf handlers: thin, typed, registered into a registry of their own so tests and `glm5 operator` build the
same operator. The work is in reconcile/.

- GLM5Deployment / RLJob created, updated or found on start-up (resume) -> apply every child, derive status.
  A bad spec -> Ready=False/InvalidSpec, a Warning Event, kopf.PermanentError; nothing is applied.
- A child deleted -> its owner is reconciled again (the child comes back).
- A StatefulSet, Deployment or worker pod changed -> the owner's status (and Ascend rank tables) is re-derived.
- Every progress_interval_s, a running RLJob's status takes its trainer's progress (GET /status on the pod).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import kopf

from glm5_operator.api import GROUP, VERSION, InvalidSpec
from glm5_operator.config import OperatorConfig
from glm5_operator.kube import Kube
from glm5_operator.reconcile import OWNER_KIND, Reconciler, WaitingFor, owner_of

log = logging.getLogger(__name__)

# (group, version, plural) of the children whose events matter; DELETED of any of them re-applies the owner.
CHILDREN = [
    ("", "v1", "configmaps"),
    ("", "v1", "services"),
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),  # served only where LWS is installed; kopf waits for it
]
STATUS_SOURCES = {"StatefulSet", "Deployment", "LeaderWorkerSet", "Pod"}
LoginFn = Callable[..., kopf.ConnectionInfo | None]


def _adopt(manifest: dict[str, Any], owner: dict[str, Any]) -> None:
    nested = "spec.template" if "template" in manifest.get("spec", {}) else None
    kopf.adopt(manifest, owner=kopf.Body(cast(kopf.RawBody, owner)), nested=nested)


def build_registry(
    config: OperatorConfig, kube: Callable[[], Kube], login: LoginFn | None = None
) -> tuple[kopf.OperatorRegistry, Callable[[], Reconciler]]:
    """The operator's handlers. `kube` makes the API client once kopf has started (after login)."""
    registry = kopf.OperatorRegistry()
    holder: dict[str, Reconciler] = {}

    def reconciler() -> Reconciler:
        if "r" not in holder:
            holder["r"] = Reconciler(kube(), config, _adopt)
        return holder["r"]

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING  # Events for problems only, not for every handler run
        settings.persistence.finalizer = f"{GROUP}/operator"
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 60
        settings.execution.max_workers = 16

    # A registry of our own has none of kopf's default logins: use the kubernetes client's, unless given one.
    kopf.on.login(registry=registry, id="login")(login or kopf.login_via_client)

    def _reconcile(body: kopf.Body, reason: str, **_: Any) -> None:
        raw = {**dict(body), "kind": body["kind"]}
        try:
            outcomes = reconciler().reconcile(raw, new=reason == kopf.Reason.CREATE)
        except InvalidSpec as exc:
            kopf.warn(body, reason="InvalidSpec", message=str(exc))
            raise kopf.PermanentError(f"invalid spec: {exc}") from exc
        except WaitingFor as exc:
            raise kopf.TemporaryError(str(exc), delay=config.retry_delay_s) from exc
        changed = {k: v for k, v in outcomes.items() if v != "unchanged"}
        if changed:
            log.info("%s %s/%s: %s", body["kind"], body.metadata.namespace, body.metadata.name, changed)

    for plural in ("glm5deployments", "rljobs"):
        kopf.on.resume(GROUP, VERSION, plural, registry=registry, id="reconcile")(_reconcile)
        kopf.on.create(GROUP, VERSION, plural, registry=registry, id="reconcile")(_reconcile)
        kopf.on.update(GROUP, VERSION, plural, registry=registry, id="reconcile")(_reconcile)

    @kopf.timer(GROUP, VERSION, "rljobs", registry=registry, id="progress", interval=config.progress_interval_s,
                initial_delay=config.progress_interval_s)  # fmt: skip
    def _progress(body: kopf.Body, **_: Any) -> None:
        """A running job's trainer reports progress only when asked (it has no API access)."""
        reconciler().refresh("RLJob", body.metadata.namespace or "", body.metadata.name or "")

    def _child_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        owner = owner_of(dict(body))
        if owner is None:
            return
        deleted = event.get("type") == "DELETED"
        if deleted and body["kind"] == "Pod":
            deleted = False  # pods belong to their StatefulSet; only the rank table and status follow them
        # A workload without status yet (just created) cannot change what the creating reconcile derived.
        fresh = body["kind"] != "Pod" and not body.get("status")
        if deleted or (body["kind"] in STATUS_SOURCES and not fresh):
            reconciler().refresh(owner[0], body.metadata.namespace or "", owner[1], recreate=deleted)

    for group, version, plural in [*CHILDREN, ("", "v1", "pods")]:
        kopf.on.event(group, version, plural, registry=registry, labels={OWNER_KIND: kopf.PRESENT})(_child_event)

    return registry, reconciler


async def run(
    config: OperatorConfig,
    kube: Callable[[], Kube] = Kube.from_environment,
    login: LoginFn | None = None,
    **operator_kwargs: Any,
) -> None:
    """Run the operator until cancelled: standalone (one replica, no peering) and cluster-wide unless the
    config names a namespace."""
    registry, _ = build_registry(config, kube, login)
    scope: dict[str, Any] = {"namespaces": [config.namespace]} if config.namespace else {"clusterwide": True}
    await kopf.operator(registry=registry, standalone=True, **scope, **operator_kwargs)
