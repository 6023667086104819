"""spec.autoscaling rendered: an HPA on an External metric (prometheus-adapter) or a KEDA ScaledObject with a
Prometheus trigger, both aimed at the GLM5Deployment's scale subresource; checked against Kubernetes' own schemas
and KEDA's CRD (vendored in tests/data/crds)."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from glm5_operator.api import InvalidSpec, parse_deployment
from glm5_operator.config import OperatorConfig
from glm5_operator.render import deployment_children
from glm5_operator.render.autoscaling import adapter_rules, quantity, signal_query

from tests.helpers.crdschema import crd_schema


def _spec(**autoscaling: Any) -> Any:
    return parse_deployment({"model": {"path": "/m"}, "autoscaling": {"maxReplicas": 4, "target": 3, **autoscaling}})


def _scaler(spec: Any, keda: bool = False, name: str = "tiny") -> dict[str, Any]:
    found = [c.manifest for c in deployment_children(name, "prod", spec, OperatorConfig(), keda)
             if c.kind in ("HorizontalPodAutoscaler", "ScaledObject")]  # fmt: skip
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("metric", ["queueDepth", "kvCacheUtilization", "inflightTokens"])
def test_hpa_targets_the_scale_subresource_on_the_adapters_external_metric(metric: str) -> None:
    target = 0.75 if metric == "kvCacheUtilization" else 3
    hpa = _scaler(_spec(metric=metric, target=target, minReplicas=2, scaleDownStabilizationSeconds=60))
    kubernetes_validate.validate(hpa, "1.33.0", strict=True)
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "glm5.ai/v1alpha1", "kind": "GLM5Deployment", "name": "tiny"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 4)
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 60
    (m,) = spec["metrics"]
    rules = {r["name"]["as"]: r for r in adapter_rules()["rules"]["external"]}
    assert m["external"]["metric"]["name"] in rules  # served by the chart's prometheus-adapter rules
    assert m["external"]["metric"]["selector"]["matchLabels"] == {
        "app_kubernetes_io_instance": "tiny", "app_kubernetes_io_component": "router"}  # fmt: skip
    # a share is compared as it is (desired = current x value / target); a count is divided by the replicas
    want = {"type": "Value", "value": "750m"} if metric == "kvCacheUtilization" else {
        "type": "AverageValue", "averageValue": "3"}  # fmt: skip
    assert m["external"]["target"] == want


def test_scaled_object_passes_kedas_schema_and_queries_this_deployments_routers() -> None:
    schema = crd_schema("keda.sh_scaledobjects.yaml", "v1alpha1")
    so = _scaler(_spec(backend="keda", metric="inflightTokens", target=2048.5), name="a")
    jsonschema.validate(so, schema)
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "2048.5"
    assert trigger["metadata"]["serverAddress"] == OperatorConfig().prometheus_url
    assert 'namespace="prod",app_kubernetes_io_instance="a",app_kubernetes_io_component="router"' in (
        trigger["metadata"]["query"])  # fmt: skip
    with pytest.raises(jsonschema.ValidationError):  # the schema check can fail
        jsonschema.validate({**so, "spec": {**so["spec"], "minReplicaCount": "one"}}, schema)


def test_backend_auto_picks_keda_only_where_it_is_served_and_overrides_apply() -> None:
    assert _scaler(_spec(), keda=False)["kind"] == "HorizontalPodAutoscaler"
    assert _scaler(_spec(), keda=True)["kind"] == "ScaledObject"
    assert _scaler(_spec(backend="hpa"), keda=True)["kind"] == "HorizontalPodAutoscaler"
    custom = _scaler(_spec(backend="keda", prometheus={"url": "http://prom:9090", "selector": 'job="routers"'}))
    (trigger,) = custom["spec"]["triggers"]
    assert trigger["metadata"]["serverAddress"] == "http://prom:9090"
    assert trigger["metadata"]["query"] == signal_query("queueDepth", 'job="routers"')
    plain = parse_deployment({"model": {"path": "/m"}})
    assert not [c for c in deployment_children("x", "ns", plain, OperatorConfig(), True)
                if c.kind in ("HorizontalPodAutoscaler", "ScaledObject")]  # fmt: skip


def test_bad_autoscaling_specs_are_refused_with_the_field() -> None:
    with pytest.raises(InvalidSpec, match="minReplicas 5 exceeds maxReplicas 4"):
        _spec(minReplicas=5)
    with pytest.raises(InvalidSpec, match="kvCacheUtilization is a share"):
        _spec(metric="kvCacheUtilization", target=80)
    with pytest.raises(InvalidSpec, match="spec.autoscaling.target"):
        _spec(target=0)
    with pytest.raises(InvalidSpec, match="spec.autoscaling.metric"):
        _spec(metric="cpu")


def test_router_pods_are_scraped_and_quantities_are_kubernetes_quantities() -> None:
    spec = parse_deployment({"model": {"path": "/m"}, "router": {"httpPort": 8080}})
    (router,) = [c.manifest for c in deployment_children("x", "ns", spec, OperatorConfig()) if c.kind == "Deployment"]
    notes = router["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == "8080"
    assert [quantity(v) for v in (3, 3.0, 0.75, 2048.5)] == ["3", "3", "750m", "2048500m"]


def test_the_scale_subresource_always_finds_a_replica_count() -> None:
    """An autoscaler GETs /scale first; the API server answers an error while specReplicasPath holds nothing, so
    a spec without `workers` gets `{}` and with it workers.replicas' default."""
    from glm5_operator.api.crds import glm5deployment_crd

    version = glm5deployment_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.workers.replicas"
    workers = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["workers"]
    assert workers["default"] == {} and workers["properties"]["replicas"]["default"] == 1
