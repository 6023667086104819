"""Child manifests rendered from specs: valid Kubernetes objects, the worker's real flags, stable names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from glm5.errors import ConfigError
from glm5.v1 import router_pb2
from glm5_cli.main import parse_args
from glm5_operator.api import parse_deployment, parse_rljob
from glm5_operator.api.validation import InvalidSpec
from glm5_operator.config import OperatorConfig
from glm5_operator.kube import _with_last_applied
from glm5_operator.render import deployment_children, rljob_children
from glm5_operator.render.common import MAX_NAME, child_name
from glm5_operator.render.workers import engine_settings
from glm5_worker.cli import config_from_args

CHART = Path(__file__).resolve().parents[3] / "charts" / "glm5"
CONFIG = OperatorConfig()


def _children(doc: dict[str, Any]) -> list[dict[str, Any]]:
    name = doc["metadata"]["name"]
    if doc["kind"] == "GLM5Deployment":
        return [c.manifest for c in deployment_children(name, "ml", parse_deployment(doc["spec"]), CONFIG)]
    ref = parse_deployment({"model": {"path": "/m"}}) if doc["spec"]["rollout"].get("deploymentRef") else None
    return [c.manifest for c in rljob_children(name, "ml", parse_rljob(doc["spec"]), CONFIG, ref)]


# the examples the operator renders (the others are plain Kubernetes objects, checked in test_api)
CUSTOM_RESOURCES = [p for p in sorted((CHART / "examples").glob("*.yaml")) if "\nkind: GLM5Deployment" in p.read_text()
                    or "\nkind: RLJob" in p.read_text()]  # fmt: skip


@pytest.mark.parametrize("example", CUSTOM_RESOURCES, ids=lambda p: p.stem)
def test_every_child_is_valid_against_the_kubernetes_schemas(example: Path) -> None:
    children = _children(yaml.safe_load(example.read_text()))
    assert len({(m["kind"], m["metadata"]["name"]) for m in children}) == len(children)
    for manifest in children:
        kubernetes_validate.validate(manifest, "1.33.0", strict=True)
        labels = manifest["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "glm5-operator"
        if "template" in manifest.get("spec", {}):
            pod = manifest["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert all(c["securityContext"]["readOnlyRootFilesystem"] for c in pod["containers"])
            assert (
                manifest["spec"]["selector"]["matchLabels"].items()
                <= manifest["spec"]["template"]["metadata"]["labels"].items()
            )


def test_strict_validation_would_catch_a_mistake() -> None:
    doc = yaml.safe_load((CHART / "examples" / "cpu.yaml").read_text())
    sts = next(m for m in _children(doc) if m["kind"] == "StatefulSet")
    sts["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, "1.33.0", strict=True)


def test_engine_config_is_what_glm5_worker_reads(tmp_path: Path) -> None:
    spec = parse_deployment({
        "model": {"path": "/models/glm5", "dtype": "bfloat16", "maxModelLen": 65536, "maxNewTokens": 512,
                  "quantization": "compressed-tensors",
                  "ropeScaling": {"type": "yarn", "factor": 4, "originalMaxPositionEmbeddings": 16384}},
        "sparseAttention": {"denseWarmupTokens": 0, "dynamicSparsity": True, "kernels": "portable"},
        "kvCache": {"bytes": "40GiB", "int8Tier": False, "l1Tokens": 256, "blockSize": 128, "prefixCaching": False,
                    "dtype": "float16", "indexDtype": "bfloat16"},
        "workers": {"accelerator": "ascend-910b", "devicesPerReplica": 8, "maxNumSeqs": 32},
        "sampling": {"ascendTemperatureFloor": 0.4},
    })  # fmt: skip
    (cm,) = [c.manifest for c in deployment_children("glm5", "ml", spec, CONFIG) if c.name == "glm5-engine"]
    path = tmp_path / "engine.json"
    path.write_text(cm["data"]["engine.json"])
    args = parse_args(["worker", "--config", str(path)])
    engine = config_from_args(args)
    assert (engine.model, engine.served_model_name, engine.device, engine.dtype) == (
        "/models/glm5",
        "glm5",
        "npu",
        "bfloat16",
    )
    assert (engine.max_model_len, engine.default_max_new_tokens) == (65536, 512)
    assert engine.quantization == "compressed-tensors"
    assert (engine.rope_scaling, engine.rope_factor, engine.rope_original_max_position_embeddings) == (
        "yarn",
        4.0,
        16384,
    )
    assert engine.kv_cache_bytes == 40 << 30 and not engine.kv_int8_tier and not engine.enable_prefix_caching
    assert (engine.l1_tokens, engine.block_size, engine.max_num_seqs) == (256, 128, 32)
    assert (engine.kv_cache_dtype, engine.kv_index_dtype) == ("float16", "bfloat16")
    assert engine.dense_warmup_tokens == 0 and engine.dynamic_sparsity and engine.kernels == "portable"
    assert engine.ascend_temperature_floor == 0.4
    # A flag on the command line still wins over the file.
    assert config_from_args(parse_args(["worker", "--config", str(path), "--max-num-seqs", "4"])).max_num_seqs == 4


def test_config_hash_rolls_pods_only_for_engine_changes() -> None:
    def template_hash(spec: dict[str, Any]) -> str:
        children = deployment_children("x", "ml", parse_deployment(spec), CONFIG)
        sts = next(c.manifest for c in children if c.kind == "StatefulSet")
        return str(sts["spec"]["template"]["metadata"]["annotations"]["glm5.ai/config-hash"])

    base = {"model": {"path": "/m"}}
    assert template_hash(base) == template_hash({**base, "workers": {"replicas": 5}})
    assert template_hash(base) != template_hash({**base, "kvCache": {"bytes": "1GiB"}})


@pytest.mark.parametrize(
    "accelerator,resource", [("nvidia", "nvidia.com/gpu"), ("ascend-910b", "huawei.com/Ascend910")]
)
def test_accelerators_request_their_extended_resource(accelerator: str, resource: str) -> None:
    spec = parse_deployment({"model": {"path": "/m"}, "workers": {"accelerator": accelerator, "devicesPerReplica": 8,
                             "resources": {"limits": {"memory": "64Gi"}}}})  # fmt: skip
    sts = next(c.manifest for c in deployment_children("x", "ml", spec, CONFIG) if c.kind == "StatefulSet")
    res = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"] == {"memory": "64Gi", resource: 8}
    assert res["requests"] == {"cpu": "1", "memory": "2Gi", resource: 8}  # default requests kept
    assert spec.workers.resources == {"limits": {"memory": "64Gi"}}  # the spec itself is not mutated
    assert engine_settings(spec, "x")["device"] == {"nvidia": "cuda", "ascend-910b": "npu"}[accelerator]


def test_long_names_stay_valid_and_distinct() -> None:
    a, b = "a" * 60 + "-one", "a" * 60 + "-two"
    for suffix in ("worker", "router-config", "ranktable"):
        na, nb = child_name(a, suffix), child_name(b, suffix)
        assert len(na) <= MAX_NAME and len(nb) <= MAX_NAME and na != nb
        assert na.endswith(f"-{suffix}") and na == child_name(a, suffix)
    assert child_name("tiny", "worker") == "tiny-worker"


def test_router_config_is_what_glm5_router_reads(tmp_path: Path) -> None:
    from glm5_router.cli import config_from_args

    spec = parse_deployment({
        "model": {"path": "/m", "servedName": "glm-5", "maxNewTokens": 300},
        "router": {"batching": {"tokenBudget": 4096, "maxWaitMs": 2}, "queues": {"maxQueued": 50},
                   "redis": {"urlSecret": {"name": "redis", "key": "url"}},
                   "circuitBreaker": {"kvFragmentation": 0.7, "sustainedSeconds": 10, "specWindowTokens": 512,
                                      "specAcceptanceDrop": 0.4, "specAcceptanceMax": 0.99}, "sm4KeySecret": "keys",
                   "thinkingPolicy": "deep", "routing": "session", "cacheIndexBlocks": 1000},
    })  # fmt: skip
    (cm,) = [c.manifest for c in deployment_children("glm5", "ml", spec, CONFIG) if c.name == "glm5-router-config"]
    path = tmp_path / "router.json"
    path.write_text(cm["data"]["router.json"])
    (dep,) = [c.manifest for c in deployment_children("glm5", "ml", spec, CONFIG) if c.kind == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (redis,) = [v for v in pod["volumes"] if v["name"] == "redis"]
    assert redis["secret"]["secretName"] == "redis" and redis["secret"]["items"] == [{"key": "url", "path": "url"}]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "redis"]
    assert json.loads(cm["data"]["router.json"])["redis-url-file"] == f"{mount['mountPath']}/url"
    assert not pod["containers"][0]["env"]  # the URL (and its password) is not in the environment
    secret_file = tmp_path / "url"  # what the mounted Secrets hold
    secret_file.write_text("redis://:pw@redis.ml.svc:6379/0\n")
    token_file = tmp_path / "token"
    token_file.write_text("internal-token\n")
    router = config_from_args(parse_args(["router", "--config", str(path), "--redis-url-file", str(secret_file),
                                          "--internal-token-file", str(token_file)]))  # fmt: skip
    assert router.internal_token is not None and router.internal_token.value == "internal-token"
    assert router.worker_dns == "glm5-worker.ml.svc:50051" and router.served_model_name == "glm-5"
    assert router.host == "0.0.0.0"  # rendered: the server default is 127.0.0.1
    assert (router.token_budget, router.max_wait_ms, router.max_queued) == (4096, 2.0, 50)
    assert router.redis_url == "redis://:pw@redis.ml.svc:6379/0"  # from the Secret, as a file
    assert "pw" not in repr(router)
    assert router.breaker.kv_fragmentation == 0.7 and router.breaker.sustained_s == 10
    b = router.breaker
    assert (b.spec_window_tokens, b.spec_acceptance_drop, b.spec_acceptance_max) == (512, 0.4, 0.99)
    assert router.sm4_key_dir == "/etc/glm5/sm4" and router.thinking_policy == "deep"
    assert (router.routing, router.cache_index_blocks) == ("session", 1000)
    assert router.default_max_new_tokens == 300


def test_gateway_config_is_what_glm5_tito_gateway_reads(tmp_path: Path) -> None:
    from glm5_tito.cli import config_from_args as gateway_config

    gateway = {"virtualNodeReserve": 0.3, "loadBound": 1.5, "tokenizerFingerprint": "a" * 64}
    job = parse_rljob({"policy": {"path": "/m"}, "rollout": {"workers": {"replicas": 4}}, "dataset": {"uri": "/d"},
                       "gateway": gateway})  # fmt: skip
    (cm,) = [c.manifest for c in rljob_children("job", "ml", job, CONFIG, None) if c.name == "job-rl"]
    path = tmp_path / "gateway.json"
    path.write_text(cm["data"]["gateway.json"])
    token_file = tmp_path / "token"  # what the mounted internal-token Secret holds
    token_file.write_text("internal-token\n")
    g = gateway_config(parse_args(["tito-gateway", "--config", str(path), "--internal-token-file", str(token_file)]))
    assert g.internal_token is not None and g.internal_token.value == "internal-token"
    assert g.engine_dns == "job-rollout-worker.ml.svc:50051" and g.tokenizer_fingerprint == "a" * 64
    assert (g.virtual_node_reserve, g.load_bound) == (0.3, 1.5)
    trainer = yaml.safe_load(cm["data"]["trainer.json"])
    assert (trainer["eps-low"], trainer["eps-high"]) == (0.15, 0.35)
    # every key is a `glm5 trainer` flag (an unknown one would be a config error at start-up)
    path.write_text(cm["data"]["trainer.json"])
    t = parse_args(["trainer", "--config", str(path)])
    assert (str(t.policy), t.engines, t.gateway) == (
        "/m",
        "job-rollout-worker.ml.svc:50051",
        "job-gateway.ml.svc:50060",
    )
    assert (t.eps_low, t.eps_high, t.staleness_limit, t.dataset, t.steps) == (0.15, 0.35, 4, "/d", 0)
    from glm5_trainer.cli import config_from_args as trainer_config

    with pytest.raises(ConfigError, match="--policy /m: no config.json"):
        trainer_config(t)


def test_security_renders_tls_api_keys_probes_and_network_policies() -> None:
    doc = yaml.safe_load((CHART / "examples" / "secure.yaml").read_text())
    children = {(m["kind"], m["metadata"]["name"]): m for m in _children(doc)}
    engine = json.loads(children["ConfigMap", "secure-engine"]["data"]["engine.json"])
    router = json.loads(children["ConfigMap", "secure-router-config"]["data"]["router.json"])
    for flags in (engine, router):
        assert flags["host"] == "0.0.0.0" and flags["health-port"] == 8081
        assert (flags["tls-cert"], flags["tls-key"], flags["tls-ca"]) == (
            "/etc/glm5/tls/tls.crt", "/etc/glm5/tls/tls.key", "/etc/glm5/tls/ca.crt")  # fmt: skip
    assert router["tls-server-name"] == "secure-worker.ml.svc"  # what the worker certificate must name
    assert router["http-tls-cert"] == "/etc/glm5/tls/tls.crt" and router["api-key-file"] == "/etc/glm5/api-keys/keys"
    for kind, name in (("StatefulSet", "secure-worker"), ("Deployment", "secure-router")):
        pod = children[kind, name]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["readinessProbe"]["grpc"]["port"] == 8081  # kubelet probes cannot speak TLS
        assert {"name": "tls", "mountPath": "/etc/glm5/tls", "readOnly": True} in container["volumeMounts"]
        assert {"name": "tls", "secret": {"secretName": "glm5-tls", "defaultMode": 0o400}} in pod["volumes"]
    # the router is ready once a worker answered (its service's health), alive while it answers at all ("")
    router_container = children["Deployment", "secure-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router_container["readinessProbe"]["grpc"]["service"] == router_pb2.DESCRIPTOR.services_by_name[
        "Router"].full_name  # fmt: skip
    assert "service" not in router_container["livenessProbe"]["grpc"]
    workers = children["NetworkPolicy", "secure-workers"]["spec"]
    assert workers["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    rule, collective = workers["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 50051}]
    # every port, but only from a trainer that syncs into these workers (gloo picks its data ports itself)
    assert collective == {"from": [{"podSelector": {"matchLabels": {"glm5.ai/syncs-into": "secure"}}}]}
    allowed = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert {"glm5.ai/client-of": "secure"} in allowed
    assert any(p.get("app.kubernetes.io/component") == "router" and p["app.kubernetes.io/instance"] == "secure"
               for p in allowed)  # fmt: skip
    router_policy = children["NetworkPolicy", "secure-router"]["spec"]
    assert router_policy["ingress"][0]["from"] == doc["spec"]["security"]["routerIngressFrom"]


def test_rljob_pods_are_clients_of_their_workers() -> None:
    spec = parse_rljob(
        {"policy": {"path": "/m"}, "rollout": {"deploymentRef": "served"}, "dataset": {"uri": "builtin"}}
    )
    ref = parse_deployment({"model": {"path": "/m"}})
    children = [c.manifest for c in rljob_children("job", "ml", spec, CONFIG, ref)]
    pods = [m["spec"]["template"]["metadata"]["labels"] for m in children if "template" in m.get("spec", {})]
    assert pods and all(labels["glm5.ai/client-of"] == "served" for labels in pods)


@pytest.mark.parametrize("security,message", [
    ({"https": True}, "needs tlsSecret"),
    ({"requireSealed": True}, "sm4KeySecret"),
    ({"healthPort": 50051}, "already another port"),
])  # fmt: skip
def test_security_settings_are_checked(security: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpec, match=message):
        parse_deployment({"model": {"path": "/m"}, "security": security})


def test_workers_get_an_admin_token_that_only_their_rl_trainers_share() -> None:
    spec = parse_deployment({"model": {"path": "/m"}})
    children = deployment_children("served", "ml", spec, CONFIG)
    (secret,) = [c for c in children if c.kind == "Secret" and c.name.endswith("-admin")]
    assert secret.create_only and secret.name == "served-admin"  # created once: reconciles keep the token
    assert len(secret.manifest["stringData"]["token"]) >= 40
    applied = _with_last_applied(secret.manifest)  # what Kube.apply creates: no copy of the token in an annotation
    assert "glm5.ai/last-applied" not in (applied["metadata"].get("annotations") or {})
    again = next(c for c in deployment_children("served", "ml", spec, CONFIG) if c.name == "served-admin")
    assert again.manifest["stringData"]["token"] != secret.manifest["stringData"]["token"]  # random, not derived
    engine = json.loads(next(c for c in children if c.name == "served-engine").manifest["data"]["engine.json"])
    assert (
        engine["admin-token-file"] == "/etc/glm5/admin/token" and engine["weights-root"] == "/var/lib/glm5/checkpoints"
    )
    sts = next(c.manifest for c in children if c.kind == "StatefulSet")["spec"]["template"]["spec"]
    assert {"name": "admin", "secret": {"secretName": "served-admin", "defaultMode": 0o400}} in sts["volumes"]
    job = parse_rljob({"policy": {"path": "/m"}, "rollout": {"deploymentRef": "served"}, "dataset": {"uri": "x"}})
    trainer = next(c.manifest for c in rljob_children("job", "ml", job, CONFIG, spec) if c.kind == "StatefulSet")
    pod = trainer["spec"]["template"]["spec"]
    assert {"name": "admin", "secret": {"secretName": "served-admin", "defaultMode": 0o400}} in pod["volumes"]
    assert {"name": "admin", "mountPath": "/etc/glm5/admin", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    settings = json.loads(next(c.manifest for c in rljob_children("job", "ml", job, CONFIG, spec)
                               if c.kind == "ConfigMap")["data"]["trainer.json"])  # fmt: skip
    assert settings["admin-token-file"] == "/etc/glm5/admin/token"


def test_every_caller_of_the_workers_gets_their_internal_token() -> None:
    """One internal-token Secret per instance, created once; mounted into its workers (which require it) and into
    every pod that calls them: the routers, an RLJob's gateway and trainer (referenced deployment or its own
    rollout workers); each one's --internal-token-file names the file of that Secret."""
    spec = parse_deployment({"model": {"path": "/m"}})
    children = deployment_children("served", "ml", spec, CONFIG)
    (secret,) = [c for c in children if c.name == "served-internal"]
    assert secret.kind == "Secret" and secret.create_only
    token = secret.manifest["stringData"]["token"]
    assert len(token) >= 40 and token != next(c for c in children if c.name == "served-admin").manifest[
        "stringData"]["token"]  # fmt: skip
    assert "glm5.ai/last-applied" not in (_with_last_applied(secret.manifest)["metadata"].get("annotations") or {})
    again = next(c for c in deployment_children("served", "ml", spec, CONFIG) if c.name == "served-internal")
    assert again.manifest["stringData"]["token"] != token  # random: the create-only Secret keeps the first one

    def flags(manifests: list[dict[str, Any]], file: str) -> dict[str, Any]:
        return dict(json.loads(next(m["data"][file] for m in manifests if file in m.get("data", {}))))

    def pod_of(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
        return dict(next(m for m in manifests if (m["kind"], m["metadata"]["name"]) == (kind, name))["spec"][
            "template"]["spec"])  # fmt: skip

    def token_secret(pod: dict[str, Any], settings: dict[str, Any]) -> str:
        volume = _mounted(pod, settings["internal-token-file"])
        assert volume is not None and volume["secret"]["defaultMode"] == 0o400
        return str(volume["secret"]["secretName"])

    served = [c.manifest for c in children]
    assert token_secret(pod_of(served, "StatefulSet", "served-worker"), flags(served, "engine.json")) == secret.name
    assert token_secret(pod_of(served, "Deployment", "served-router"), flags(served, "router.json")) == secret.name
    for rollout, instance in (({"deploymentRef": "served"}, "served"), ({"workers": {"replicas": 1}}, "job-rollout")):
        job = parse_rljob({"policy": {"path": "/m"}, "rollout": rollout, "dataset": {"uri": "x"}})
        manifests = [c.manifest for c in rljob_children("job", "ml", job, CONFIG, spec)]
        assert token_secret(pod_of(manifests, "Deployment", "job-gateway"), flags(manifests, "gateway.json")) == (
            f"{instance}-internal")  # fmt: skip
        assert token_secret(pod_of(manifests, "StatefulSet", "job-trainer"), flags(manifests, "trainer.json")) == (
            f"{instance}-internal")  # fmt: skip
        own = [m["metadata"]["name"] for m in manifests if m["kind"] == "Secret"]
        assert own == ([] if instance == "served" else ["job-rollout-admin", "job-rollout-internal"])


def _mounted(pod: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The volume a container path lies on (the deepest mount above it), or None."""
    mounts = sorted(pod["containers"][0]["volumeMounts"], key=lambda m: len(m["mountPath"]), reverse=True)
    for m in mounts:
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"):
            return next(v for v in pod["volumes"] if v["name"] == m["name"])
    return None


def test_trainer_mounts_what_its_config_names_and_syncs_weights() -> None:
    """The trainer reads its policy from the policy claim and its dataset from the dataset claim; it syncs each
    version into the workers by collective from its pod's address, which their NetworkPolicy admits on every
    port; with weightTransport: stream the workers it pushes to stage the streamed files on a writable volume of
    their own (they share none with the trainer)."""
    doc = yaml.safe_load((CHART / "examples" / "rljob.yaml").read_text())
    spec = parse_rljob(doc["spec"])
    served = parse_deployment(yaml.safe_load((CHART / "examples" / "cpu.yaml").read_text())["spec"])
    children = [c.manifest for c in rljob_children("job", "ml", spec, CONFIG, served)]
    trainer = next(m for m in children if m["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    settings = json.loads(next(m for m in children if m["kind"] == "ConfigMap")["data"]["trainer.json"])
    policy, dataset = _mounted(trainer, settings["policy"]), _mounted(trainer, settings["dataset"])
    assert policy is not None and policy["persistentVolumeClaim"]["claimName"] == doc["spec"]["policy"]["pvcName"]
    assert dataset is not None and dataset["persistentVolumeClaim"]["claimName"] == doc["spec"]["dataset"]["pvcName"]
    assert settings["weights-transport"] == "collective" and settings["sync-port"] == 29600
    assert settings["activation-checkpointing"] is False  # a flag the trainer's parser takes from the file
    pod = next(m for m in children if m["kind"] == "StatefulSet")["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["args"][-2:] == ["--sync-address", "$(POD_IP)"]  # the kubelet expands it
    assert container["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert {"name": "sync", "containerPort": 29600, "protocol": "TCP"} in container["ports"]
    assert pod["metadata"]["labels"]["glm5.ai/syncs-into"] == "tiny"
    policy_of = next(c.manifest for c in deployment_children("tiny", "ml", served, CONFIG) if c.kind == "NetworkPolicy"
                     and c.name == "tiny-workers")  # fmt: skip
    admitted = [r for r in policy_of["spec"]["ingress"] if "ports" not in r]
    assert admitted == [{"from": [{"podSelector": {"matchLabels": {"glm5.ai/syncs-into": "tiny"}}}]}]

    doc["spec"]["trainer"]["weightTransport"] = "stream"
    children = [c.manifest for c in rljob_children("job", "ml", parse_rljob(doc["spec"]), CONFIG, served)]
    settings = json.loads(next(m for m in children if m["kind"] == "ConfigMap")["data"]["trainer.json"])
    pod = next(m for m in children if m["kind"] == "StatefulSet")["spec"]["template"]
    assert settings["weights-transport"] == "stream" and "sync-port" not in settings
    assert "env" not in pod["spec"]["containers"][0] and "glm5.ai/syncs-into" not in pod["metadata"]["labels"]
    workers = next(c.manifest for c in deployment_children("tiny", "ml", served, CONFIG) if c.kind == "StatefulSet")
    engine = json.loads(next(c.manifest for c in deployment_children("tiny", "ml", served, CONFIG)
                             if c.name == "tiny-engine")["data"]["engine.json"])  # fmt: skip
    assert _mounted(workers["spec"]["template"]["spec"], engine["weights-root"]) == {"name": "weights", "emptyDir": {}}


@pytest.mark.parametrize("dataset,message", [
    ({"uri": "/elsewhere/a.jsonl", "pvcName": "d"}, "must be under mountPath /data"),
    ({"uri": "/models/x.jsonl", "pvcName": "d", "mountPath": "/models"}, "must not nest"),
])  # fmt: skip
def test_dataset_claims_are_checked(dataset: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpec, match=message):
        parse_rljob({"policy": {"path": "/models/p"}, "rollout": {"deploymentRef": "s"}, "dataset": dataset})


def test_a_trainer_over_two_pods(tmp_path: Path) -> None:
    """trainer.nodes: 2: one StatefulSet of two pods started together, pod i being node i of the trainer's world
    (its pod-index label through the downward API), rendezvousing at pod 0's stable name behind a headless Service
    that publishes pods before they are ready, and one ReadWriteMany checkpoint claim both mount. The flags parse
    as `glm5 trainer`'s."""
    doc = yaml.safe_load((CHART / "examples" / "rljob.yaml").read_text())
    doc["spec"]["trainer"] |= {"nodes": 2, "devices": 2, "checkpointStorageClass": "nfs", "checkpointSize": "1Ti"}
    served = parse_deployment(yaml.safe_load((CHART / "examples" / "cpu.yaml").read_text())["spec"])
    children = {(c.kind, c.name): c for c in rljob_children("job", "ml", parse_rljob(doc["spec"]), CONFIG, served)}
    for c in children.values():
        kubernetes_validate.validate(c.manifest, "1.33.0", strict=True)
    sts = children["StatefulSet", "job-trainer"].manifest["spec"]
    assert sts["replicas"] == 2 and sts["podManagementPolicy"] == "Parallel" and "volumeClaimTemplates" not in sts
    service = children["Service", "job-trainer-ranks"].manifest["spec"]
    assert sts["serviceName"] == "job-trainer-ranks" and service["clusterIP"] == "None"
    assert service["publishNotReadyAddresses"] is True and service["ports"][0]["port"] == 29500
    claim = children["PersistentVolumeClaim", "checkpoints-job-trainer"]
    assert claim.create_only and not claim.owned  # the checkpoints outlive the job, as a StatefulSet's claims do
    assert claim.manifest["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Ti"}},
                                      "storageClassName": "nfs"}  # fmt: skip
    pod = sts["template"]["spec"]
    assert _mounted(pod, "/var/lib/glm5/checkpoints") == {
        "name": "checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints-job-trainer"}}  # fmt: skip
    container = pod["containers"][0]
    assert {
        "name": "POD_INDEX",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
    } in container["env"]
    assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in container["ports"]
    path = tmp_path / "trainer.json"
    path.write_text(children["ConfigMap", "job-rl"].manifest["data"]["trainer.json"])
    # what the kubelet runs in pod 1 (it expands $(POD_INDEX) from the env)
    args = [a.replace("$(POD_INDEX)", "1").replace("$(POD_IP)", "10.0.0.7") for a in container["args"]]
    args[args.index("--config") + 1] = str(path)
    t = parse_args(args)
    assert (t.nnodes, t.nproc_per_node, t.node_rank, t.master_port) == (2, 2, 1, 29500)
    assert t.master_addr == "job-trainer-0.job-trainer-ranks.ml.svc" and t.sync_address == "10.0.0.7"

    with pytest.raises(InvalidSpec, match="masterPort: 29600 is already"):  # the collective's store port
        parse_rljob({**doc["spec"], "trainer": {**doc["spec"]["trainer"], "masterPort": 29600}})
    one = {(c.kind, c.name) for c in rljob_children("job", "ml", parse_rljob({**doc["spec"], "trainer": {}}), CONFIG,
                                                     served)}  # fmt: skip
    assert ("Service", "job-trainer-ranks") not in one and (
        "PersistentVolumeClaim",
        "checkpoints-job-trainer",
    ) not in one
