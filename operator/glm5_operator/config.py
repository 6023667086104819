"""The operator's own settings: images and timings, from the environment the chart sets."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_IMAGE = "ghcr.io/glm5-stack/glm5:0.1.0"
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"  # kube-prometheus-stack's


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    image: str = DEFAULT_IMAGE  # one image, several entrypoints (worker, router, gateway, trainer)
    image_pull_policy: str = "IfNotPresent"
    namespace: str | None = None  # watch one namespace; None watches all
    retry_delay_s: float = 5.0  # TemporaryError delay while something the reconcile needs is missing
    worker_startup_seconds: int = 1800  # checkpoint loading budget for the startup probe
    progress_interval_s: float = 15.0  # how often a running RLJob's trainer is asked for its progress
    # where KEDA's Prometheus triggers query (spec.autoscaling.prometheus.url overrides it)
    prometheus_url: str = DEFAULT_PROMETHEUS_URL
    # how long "does the cluster serve KEDA / LeaderWorkerSets" stands before it is asked again (CRDs come rarely)
    api_recheck_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("the operator needs a default image (GLM5_IMAGE)")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ValueError(
                f"GLM5_IMAGE_PULL_POLICY must be Always, IfNotPresent or Never, not {self.image_pull_policy!r}"
            )
        if self.progress_interval_s <= 0:
            raise ValueError("GLM5_RLJOB_PROGRESS_SECONDS must be > 0")
        if not self.prometheus_url.startswith(("http://", "https://")):
            raise ValueError(f"GLM5_PROMETHEUS_URL must be an http(s) URL, not {self.prometheus_url!r}")
        if self.worker_startup_seconds < 10:
            raise ValueError("GLM5_WORKER_STARTUP_SECONDS must be at least 10")

    @classmethod
    def from_env(cls) -> OperatorConfig:
        env = os.environ
        return cls(
            image=env.get("GLM5_IMAGE", DEFAULT_IMAGE),
            image_pull_policy=env.get("GLM5_IMAGE_PULL_POLICY", "IfNotPresent"),
            namespace=env.get("GLM5_WATCH_NAMESPACE") or None,
            retry_delay_s=float(env.get("GLM5_RETRY_DELAY_SECONDS", "5")),
            worker_startup_seconds=int(env.get("GLM5_WORKER_STARTUP_SECONDS", "1800")),
            progress_interval_s=float(env.get("GLM5_RLJOB_PROGRESS_SECONDS", "15")),
            prometheus_url=env.get("GLM5_PROMETHEUS_URL") or DEFAULT_PROMETHEUS_URL,
            api_recheck_s=float(env.get("GLM5_API_RECHECK_SECONDS", "60")),
        )
