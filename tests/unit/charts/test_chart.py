"""The Helm chart, checked with a real helm v4 binary (scripts/get-helm) and the Kubernetes OpenAPI schemas."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from glm5_operator.api import parse_deployment, parse_rljob
from glm5_operator.api.rljob import TRAINER_STATUS_PORT
from glm5_operator.config import OperatorConfig
from glm5_operator.kube import PLURALS
from glm5_operator.render import deployment_children, rljob_children

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "glm5"
HELM = Path(os.environ.get("GLM5_HELM", ROOT / ".cache" / "tools" / "helm"))
VARIANTS = {
    "default": [],
    "namespaced": ["--set", "operator.watchNamespace=ml", "--set", "operator.logLevel=debug"],
    "no-sa": ["--set", "serviceAccount.create=false", "--set", "serviceAccount.name=existing"],
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert HELM.exists(), f"no helm binary at {HELM}: run scripts/get-helm (scripts/bootstrap does)"
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=check, timeout=120)


def render(*extra: str) -> list[dict[str, Any]]:
    out = helm("template", "glm5", str(CHART), "--namespace", "glm5-system", "--include-crds", *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_strict_is_clean(variant: str) -> None:
    result = helm("lint", "--strict", str(CHART), *VARIANTS[variant])
    assert "0 chart(s) failed" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_manifests_pass_kubernetes_validate_strict(variant: str) -> None:
    docs = render(*VARIANTS[variant])
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole"} <= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)


def _rules(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(d["metadata"]["name"], r) for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]


def test_rbac_is_least_privilege_and_split() -> None:
    rules = _rules(render())
    for role, rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], f"wildcard {key} in {role}"
        assert not {"deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"]), role
        # the one delete: the autoscalers it renders, pruned when spec.autoscaling goes (never a workload or a claim)
        if "delete" in rule["verbs"]:
            assert set(rule["resources"]) <= {"horizontalpodautoscalers", "scaledobjects"}, (role, rule)
    status = [role for role, r in rules if any(x.endswith("/status") for x in r["resources"])]
    finalizers = [role for role, r in rules if any(x.endswith("/finalizers") for x in r["resources"])]
    assert status and finalizers and set(status).isdisjoint(finalizers)
    assert all(role.endswith("-status") for role in status) and all(role.endswith("-finalizers") for role in finalizers)


def test_rbac_covers_every_child_the_operator_creates() -> None:
    """The manager role must allow create+patch of every kind rendering produces (no drift between them)."""
    config = OperatorConfig()
    spec = parse_deployment({"model": {"path": "/m"}, "workers": {"accelerator": "ascend-910b"}})
    job = parse_rljob({"policy": {"path": "/m"}, "rollout": {"workers": {}}, "dataset": {"uri": "/d"}})
    # a trainer over two pods adds its headless Service and the claim its pods share
    pods = parse_rljob({"policy": {"path": "/m"}, "rollout": {"workers": {}}, "dataset": {"uri": "/d"},
                        "trainer": {"nodes": 2}})  # fmt: skip
    children = [*deployment_children("x", "ns", spec, config), *rljob_children("y", "ns", job, config, None),
                *rljob_children("z", "ns", pods, config, None)]  # fmt: skip
    assert "PersistentVolumeClaim" in {c.kind for c in children}
    allowed = {
        (g, res, v) for _, r in _rules(render()) for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]
    }
    for child in children:
        m = child.manifest
        group = m["apiVersion"].rpartition("/")[0]
        # created once, never patched or watched: get and create only (the admin- and internal-token Secrets)
        verbs = ("get", "create") if child.create_only else ("get", "list", "watch", "create", "patch")
        for verb in verbs:
            assert (group, PLURALS[m["kind"]], verb) in allowed, (m["kind"], verb)
    assert ("", "secrets", "list") not in allowed and ("", "secrets", "patch") not in allowed  # least privilege
    for verb in ("get", "list", "watch"):  # rank tables follow the worker pods
        assert ("", "pods", verb) in allowed


def test_operator_deployment_is_hardened() -> None:
    (dep,) = [d for d in render() if d["kind"] == "Deployment"]
    assert dep["spec"]["replicas"] == 1
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]
    assert c["args"][0] == "operator"
    assert set(dep["spec"]["selector"]["matchLabels"]) == {"app.kubernetes.io/name", "app.kubernetes.io/instance"}


def test_values_schema_rejects_bad_values() -> None:
    result = helm("template", "glm5", str(CHART), "--set", "operator.healthPort=70000", check=False)
    assert result.returncode != 0 and "healthPort" in result.stderr
    result = helm("template", "glm5", str(CHART), "--set", "operater.logLevel=debug", check=False)
    assert result.returncode != 0 and "operater" in result.stderr


def _leaves(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{path}.{k}" if path else k)]
    return [path]


def test_every_value_is_documented_and_typed() -> None:
    text = (CHART / "values.yaml").read_text()
    params = set(re.findall(r"## @param (\S+)", text))
    schema = json.loads((CHART / "values.schema.json").read_text())
    for leaf in _leaves(yaml.safe_load(text)):
        documented = any(leaf == p or leaf.startswith(p + ".") for p in params)
        assert documented, f"{leaf} has no ## @param line in values.yaml"
        node = schema
        for part in leaf.split("."):
            if part not in node.get("properties", {}):
                break  # free-form object below here (resources, nodeSelector, ...)
            node = node["properties"][part]
            assert node.get("description"), f"{leaf}: no description in values.schema.json"


def test_operator_network_policy_allows_only_the_api_server_dns_and_trainer_status() -> None:
    docs = render()
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["spec"]["ingress"] == []
    ports = sorted((p["protocol"], p["port"]) for rule in policy["spec"]["egress"] for p in rule["ports"])
    assert ports == [("TCP", 53), ("TCP", 443), ("TCP", 6443), ("TCP", TRAINER_STATUS_PORT), ("UDP", 53)]
    (trainers,) = [r for r in policy["spec"]["egress"] if r["ports"] == [{"protocol": "TCP", "port": 8081}]]
    (peer,) = trainers["to"]  # trainer pods only (the labels the operator renders on them), in any namespace
    job = parse_rljob({"policy": {"path": "/m"}, "rollout": {"workers": {}}, "dataset": {"uri": "/d"}})
    trainer = next(c.manifest for c in rljob_children("y", "ns", job, OperatorConfig(), None) if c.name == "y-trainer")
    labels = trainer["spec"]["template"]["metadata"]["labels"]
    assert peer["namespaceSelector"] == {} and peer["podSelector"]["matchLabels"].items() <= labels.items()
    narrowed = render("--set", "networkPolicy.apiServerCIDRs={10.0.0.1/32}")
    (policy,) = [d for d in narrowed if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["egress"][0]["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    assert not [d for d in render("--set", "networkPolicy.enabled=false") if d["kind"] == "NetworkPolicy"]


def test_notes_commands_give_the_examples_from_the_installed_chart(tmp_path: Path) -> None:
    """NOTES.txt's commands, run with a real kubectl against an API holding the rendered chart, print the chart's
    examples byte for byte (no placeholder URL, no copy of the chart needed)."""
    import asyncio

    from tests.helpers.kube import emulated_cluster, kubectl

    notes = helm("install", "x", str(CHART), "--namespace", "glm5-system", "--dry-run=client").stdout
    notes = notes[notes.index("NOTES:") :]
    assert "https://..." not in notes
    commands = re.findall(r"^\s+(kubectl -n \S+ get configmap .*?) \| kubectl apply -f -$", notes, re.M)
    assert len(commands) == 2, notes
    rendered = yaml.safe_load_all(helm("template", "x", str(CHART), "--namespace", "glm5-system").stdout)
    (config_map,) = [d for d in rendered if d and d["metadata"]["name"] == "x-glm5-examples"]
    (tmp_path / "cm.yaml").write_text(yaml.safe_dump(config_map))

    async def go() -> list[str]:
        async with emulated_cluster() as emulator:
            server = str(emulator.url).rstrip("/")
            await asyncio.to_thread(kubectl, server, "apply", "-f", str(tmp_path / "cm.yaml"), namespace="glm5-system")
            outs = []
            for command in commands:
                args = shlex.split(command)[1:]  # as a shell would pass them
                outs.append(await asyncio.to_thread(kubectl, server, *args[2:], namespace=args[1]))
            return outs

    demo, cpu = asyncio.run(go())
    assert demo == (CHART / "examples" / "demo-data.yaml").read_text()
    assert cpu == (CHART / "examples" / "cpu.yaml").read_text()
    listed = re.search(r"The other examples: (.*)$", notes, re.M)
    assert listed is not None and set(listed.group(1).split()) == {p.name for p in (CHART / "examples").glob("*.yaml")}


def test_notes_name_the_examples_own_resources() -> None:
    """NOTES.txt said `svc/<name>-router`: the commands after applying cpu.yaml name its GLM5Deployment."""
    notes = helm("install", "x", str(CHART), "--namespace", "glm5-system", "--dry-run=client").stdout
    notes = notes[notes.index("NOTES:") :]
    name = yaml.safe_load((CHART / "examples" / "cpu.yaml").read_text())["metadata"]["name"]
    assert "<name>" not in notes
    for command in (f"kubectl get glm5d {name} -w", f"kubectl port-forward svc/{name}-router 8000:8000",
                    f"kubectl scale glm5d {name} --replicas 2", f"kubectl get glm5d {name} -o jsonpath="):  # fmt: skip
        assert command in notes, command
    assert "demo-data-one-node.yaml" in notes.split("The other examples:")[0]  # said where a one-node user needs it


def test_the_one_node_demo_data_differs_only_in_access_modes() -> None:
    """demo-data-one-node.yaml (kind, minikube) is demo-data.yaml with ReadWriteOnce claims: the same claims, Job
    and image, so the other examples work on it unchanged."""
    shared = list(yaml.safe_load_all((CHART / "examples" / "demo-data.yaml").read_text()))
    one_node = list(yaml.safe_load_all((CHART / "examples" / "demo-data-one-node.yaml").read_text()))
    claims = [d for d in one_node if d["kind"] == "PersistentVolumeClaim"]
    assert {c["metadata"]["name"] for c in claims} == {"glm5-models", "glm5-datasets"}
    assert all(c["spec"]["accessModes"] == ["ReadWriteOnce"] for c in claims)
    for doc in shared:
        if doc["kind"] == "PersistentVolumeClaim":
            doc["spec"]["accessModes"] = ["ReadWriteOnce"]
    assert one_node == shared
    for doc in one_node:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
