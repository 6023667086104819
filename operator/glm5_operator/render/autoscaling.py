"""The autoscaler of a GLM5Deployment (spec.autoscaling): a KEDA ScaledObject or a HorizontalPodAutoscaler, both
aimed at the GLM5Deployment's own scale subresource (spec.workers.replicas), so the operator stays the only writer
of the worker StatefulSets.

The signals come from the routers' /metrics (every router polls every worker, so one scrape of the routers sees
the fleet). A signal is one PromQL expression over this deployment's router pods: the routers' own series are
summed over router replicas, the workers' polled ones de-duplicated by worker first (every router reports them).
KEDA's Prometheus trigger runs the expression itself; for an HPA, prometheus-adapter serves it as an External
metric through the rules `adapter_rules()` writes (charts/glm5/files/prometheus-adapter-rules.yaml, by
scripts/gen-crds), with `<<.LabelMatchers>>` standing for the selector.
"""

from __future__ import annotations

from typing import Any

from glm5_operator.api.base import API_VERSION
from glm5_operator.api.deployment import Autoscaling, GLM5DeploymentSpec
from glm5_operator.render.common import child_name, metadata

COMPONENT = "autoscaler"
KEDA_API = "keda.sh/v1alpha1"
HPA_API = "autoscaling/v2"
KINDS = (("HorizontalPodAutoscaler", HPA_API), ("ScaledObject", KEDA_API))
ROUTER_COMPONENT = "router"
# the scraped pod's labels as Prometheus' kubernetes-pods job maps them (labelmap of the pod's labels)
INSTANCE_LABEL, COMPONENT_LABEL = "app_kubernetes_io_instance", "app_kubernetes_io_component"
# metric -> (External metric name under prometheus-adapter, target type: AverageValue divides by the replicas)
SIGNALS = {
    "queueDepth": ("glm5_queue_depth", "AverageValue"),
    "kvCacheUtilization": ("glm5_kv_cache_utilization", "Value"),
    "inflightTokens": ("glm5_inflight_tokens", "AverageValue"),
}


def autoscaler_name(instance: str) -> str:
    return child_name(instance, COMPONENT)


def default_selector(instance: str, namespace: str) -> str:
    return f'namespace="{namespace}",{INSTANCE_LABEL}="{instance}",{COMPONENT_LABEL}="{ROUTER_COMPONENT}"'


def signal_query(metric: str, selector: str) -> str:
    """The deployment-wide value of `metric` over the series `selector` matches."""
    s = "{" + selector + "}"
    if metric == "queueDepth":  # queued in the routers + waiting inside the workers
        return (f"(sum(glm5_router_queue_depth{s}) or vector(0)) + "
                f"(sum(max by (worker) (glm5_worker_requests_waiting{s})) or vector(0))")  # fmt: skip
    if metric == "kvCacheUtilization":
        return f"avg(max by (worker) (glm5_worker_kv_usage_ratio{s}))"
    if metric == "inflightTokens":
        return f"sum(glm5_router_inflight_tokens{s}) or vector(0)"
    raise ValueError(f"unknown autoscaling metric {metric!r}")


def quantity(value: float) -> str:
    """A Kubernetes quantity: whole numbers as they are, others in thousandths (0.75 -> 750m)."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def _behavior(a: Autoscaling) -> dict[str, Any]:
    return {"scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_seconds}}


def _target(instance: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GLM5Deployment", "name": instance}


def scaled_object(instance: str, namespace: str, a: Autoscaling, prometheus_url: str) -> dict[str, Any]:
    selector = a.prometheus.selector or default_selector(instance, namespace)
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": metadata(autoscaler_name(instance), namespace, instance, COMPONENT),
        "spec": {
            "scaleTargetRef": _target(instance),
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "pollingInterval": a.polling_interval_seconds,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(a)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": SIGNALS[a.metric][1],
                    "metadata": {
                        "serverAddress": a.prometheus.url or prometheus_url,
                        "query": signal_query(a.metric, selector),
                        "threshold": str(a.target),
                    },
                }
            ],
        },
    }


def horizontal_pod_autoscaler(instance: str, namespace: str, a: Autoscaling) -> dict[str, Any]:
    name, kind = SIGNALS[a.metric]
    # prometheus-adapter adds the HPA's namespace to these itself
    match = {INSTANCE_LABEL: instance, COMPONENT_LABEL: ROUTER_COMPONENT}
    target = {"type": kind, ("averageValue" if kind == "AverageValue" else "value"): quantity(a.target)}
    return {
        "apiVersion": HPA_API,
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(autoscaler_name(instance), namespace, instance, COMPONENT),
        "spec": {
            "scaleTargetRef": _target(instance),
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "behavior": _behavior(a),
            "metrics": [
                {
                    "type": "External",
                    "external": {"metric": {"name": name, "selector": {"matchLabels": match}}, "target": target},
                }
            ],
        },
    }


def autoscaler(
    instance: str, namespace: str, spec: GLM5DeploymentSpec, keda: bool, prometheus_url: str
) -> dict[str, Any] | None:
    """The autoscaler to apply (None: spec.autoscaling is unset); `keda`: whether the ScaledObject API is served."""
    a = spec.autoscaling
    if a is None:
        return None
    if a.backend == "keda" or (a.backend == "auto" and keda):
        return scaled_object(instance, namespace, a, prometheus_url)
    return horizontal_pod_autoscaler(instance, namespace, a)


def adapter_rules() -> dict[str, Any]:
    """prometheus-adapter's `rules.external` (its Helm chart's values) serving each signal as an External metric."""
    rules = []
    for metric, (name, _) in SIGNALS.items():
        series = {"queueDepth": "glm5_router_queue_depth", "kvCacheUtilization": "glm5_worker_kv_usage_ratio",
                  "inflightTokens": "glm5_router_inflight_tokens"}[metric]  # fmt: skip
        rules.append({
            "seriesQuery": f'{series}{{{COMPONENT_LABEL}="{ROUTER_COMPONENT}"}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
            "name": {"as": name},
            "metricsQuery": signal_query(metric, "<<.LabelMatchers>>"),
        })  # fmt: skip
    return {"rules": {"external": rules}}
