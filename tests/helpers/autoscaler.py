"""What scales a GLM5Deployment in a cluster, for tests: a real Prometheus scraping the pods the pod runner runs, and
the HorizontalPodAutoscaler controller's algorithm over the autoscalers in the API.

Prometheus (the Debian package's binary) finds its targets through a file (file_sd) written from the pods in the
API the way its usual kubernetes-pods job would: pods annotated prometheus.io/scrape, at their IP and
prometheus.io/port, labelled with namespace, pod and their own labels (labelmap: `app.kubernetes.io/instance` ->
`app_kubernetes_io_instance`).

The controller reads every HorizontalPodAutoscaler (autoscaling/v2, External metrics, through prometheus-adapter's
rules in charts/glm5/files: `<<.LabelMatchers>>` becomes the HPA's namespace and metric selector) and every KEDA
ScaledObject (its Prometheus trigger's query, as the HPA KEDA creates would), queries Prometheus and writes the scale
subresource as kube-controller-manager does: AverageValue targets want ceil(value / target) replicas, Value
targets ceil(current x value / target), nothing changes within the 10% tolerance, the result is clamped to
[min, max] and a scale-down takes the highest recommendation of its stabilization window.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from glm5_operator.kube import Kube, Ref

from tests.helpers.periodic import cancel, every
from tests.helpers.procs import free_port

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
ADAPTER_RULES = ROOT / "charts" / "glm5" / "files" / "prometheus-adapter-rules.yaml"
TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance


class Prometheus:
    """A prometheus process on a localhost port, scraping every `scrape_s`."""

    def __init__(self, workdir: Path, scrape_s: float = 1.0) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: apt-get install -y prometheus (.ci/run does)"
        workdir.mkdir(parents=True, exist_ok=True)
        self.targets_file = workdir / "targets.json"
        self.targets_file.write_text("[]")
        config = {
            "global": {"scrape_interval": f"{scrape_s:g}s", "scrape_timeout": f"{scrape_s:g}s"},
            "scrape_configs": [{"job_name": "kubernetes-pods",
                                "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}]}],
        }  # fmt: skip
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                if r.status == 200:
                    return
            assert self.proc.poll() is None, f"prometheus exited: {(workdir / 'prometheus.log').read_text()[-2000:]}"
            time.sleep(0.2)
        raise AssertionError("prometheus did not become ready in 30 s")

    def set_targets(self, targets: list[tuple[str, dict[str, str]]]) -> None:
        text = json.dumps([{"targets": [address], "labels": labels} for address, labels in targets], sort_keys=True)
        if self.targets_file.read_text() != text:
            tmp = self.targets_file.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.targets_file)  # atomically: Prometheus may read it at any moment

    def query(self, expr: str) -> float | None:
        """An instant query's value (None: an empty result)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        result = body["data"]["result"]
        if not result:
            return None
        assert len(result) == 1, f"{expr} gave {len(result)} series: {result}"
        return float(result[0]["value"][1])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def scrape_targets(pods: list[dict[str, Any]]) -> list[tuple[str, dict[str, str]]]:
    """The kubernetes-pods job's view: running pods annotated for scraping, with their labels mapped."""
    out = []
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        notes = meta.get("annotations") or {}
        if notes.get("prometheus.io/scrape") != "true" or status.get("phase") != "Running" or not status.get("podIP"):
            continue
        labels = {re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in (meta.get("labels") or {}).items()}
        labels |= {"namespace": meta["namespace"], "pod": meta["name"]}
        out.append((f"{status['podIP']}:{notes.get('prometheus.io/port', '80')}", labels))
    return out


def _quantity(raw: str | int | float) -> float:
    text = str(raw)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@dataclass
class Autoscaler:
    kube: Kube
    namespace: str
    prometheus: Prometheus
    rules: dict[str, str] = field(default_factory=dict)  # External metric name -> metricsQuery
    history: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # recommendations per autoscaler
    decisions: list[tuple[str, int, int, float | None]] = field(default_factory=list)  # (name, from, to, value)
    last: dict[str, tuple[float | None, str, float]] = field(default_factory=dict)  # each autoscaler's last signal
    _task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        for rule in yaml.safe_load(ADAPTER_RULES.read_text())["rules"]["external"]:
            self.rules[rule["name"]["as"]] = rule["metricsQuery"]

    async def start(self, interval: float = 1.0) -> None:
        self._task = every(interval, lambda: asyncio.to_thread(self.sync), "autoscaler")

    async def stop(self) -> None:
        await cancel(self._task)

    def sync(self) -> None:
        self.prometheus.set_targets(scrape_targets(self.kube.list(Ref("v1", "Pod", self.namespace))))
        for hpa in self.kube.list(Ref("autoscaling/v2", "HorizontalPodAutoscaler", self.namespace)):
            self._scale(hpa["metadata"]["name"], self._hpa_signal(hpa), hpa["spec"])
        with contextlib.suppress(Exception):  # the ScaledObject API exists only where KEDA is installed
            for so in self.kube.list(Ref("keda.sh/v1alpha1", "ScaledObject", self.namespace)):
                self._scale(so["metadata"]["name"], self._keda_signal(so), so["spec"])

    def _hpa_signal(self, hpa: dict[str, Any]) -> tuple[float | None, str, float]:
        (metric,) = hpa["spec"]["metrics"]
        external = metric["external"]
        matchers = {"namespace": self.namespace, **external["metric"].get("selector", {}).get("matchLabels", {})}
        query = self.rules[external["metric"]["name"]].replace(
            "<<.LabelMatchers>>", ",".join(f'{k}="{v}"' for k, v in matchers.items())
        )
        target = external["target"]
        kind = target["type"]
        return self.prometheus.query(query), kind, _quantity(target["averageValue" if kind == "AverageValue" else
                                                                       "value"])  # fmt: skip

    def _keda_signal(self, so: dict[str, Any]) -> tuple[float | None, str, float]:
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        value = self.prometheus.query(trigger["metadata"]["query"])
        return value, trigger.get("metricType", "AverageValue"), float(trigger["metadata"]["threshold"])

    def describe(self) -> str:
        """The last signals and the scrape targets' health (for a test's failure message)."""
        try:
            up = urllib.request.urlopen(f"{self.prometheus.url}/api/v1/targets", timeout=5).read().decode()[:1500]
        except OSError as exc:
            up = repr(exc)
        return f"decisions {self.decisions}; last signals {self.last}; targets {up}"

    def _scale(self, name: str, signal: tuple[float | None, str, float], spec: dict[str, Any]) -> None:
        self.last[name] = signal
        value, kind, target = signal
        ref_spec = spec["scaleTargetRef"]
        ref = Ref(ref_spec["apiVersion"], ref_spec["kind"], self.namespace, ref_spec["name"])
        scale = self.kube.get(ref, "scale")
        if scale is None or value is None or not scale["spec"].get("replicas"):
            return  # no target, no metric yet, or scaled to zero by hand (the HPA then stands aside)
        spec_replicas, current = int(scale["spec"]["replicas"]), int(scale["status"].get("replicas") or 0)
        lo = int(spec.get("minReplicas", spec.get("minReplicaCount", 1)))
        hi = int(spec.get("maxReplicas", spec.get("maxReplicaCount", lo)))
        if kind == "AverageValue":
            ratio = value / (target * max(current, 1))
            desired = current if abs(ratio - 1) <= TOLERANCE else math.ceil(value / target)
        else:
            ratio = value / target
            desired = current if abs(ratio - 1) <= TOLERANCE else math.ceil(ratio * current)
        desired = min(max(desired, lo), hi)
        behavior = spec.get("behavior") or (spec.get("advanced") or {}).get("horizontalPodAutoscalerConfig", {}).get(
            "behavior", {})  # fmt: skip
        window = float((behavior.get("scaleDown") or {}).get("stabilizationWindowSeconds", 300))
        now = time.monotonic()
        recent = [(t, r) for t, r in self.history.get(name, []) if now - t <= window] + [(now, desired)]
        self.history[name] = recent
        if desired < spec_replicas:
            desired = min(spec_replicas, max(r for _, r in recent))
        if desired != spec_replicas:
            self.kube.patch(ref, {"spec": {"replicas": desired}}, "scale")
            self.decisions.append((name, spec_replicas, desired, value))
            log.info("autoscaler %s: %d -> %d replicas (%s %.3g, target %.3g)", name, spec_replicas, desired,
                     kind, value, target)  # fmt: skip
