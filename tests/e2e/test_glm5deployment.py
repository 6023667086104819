"""A GLM5Deployment from `kubectl apply` to a streamed answer, without a cluster: the real operator (kopf) against
the kmock API emulator, and tests/helpers/podrunner.py running the pods it renders as real processes in their own
mount namespaces (issue 18)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import yaml
from glm5.client import sampling
from glm5.model.presets import SHIPPED_MODEL
from glm5.v1 import router_pb2, router_pb2_grpc, worker_pb2
from glm5_operator.config import OperatorConfig
from glm5_operator.kube import Kube

from tests.helpers.kube import OperatorThread, emulated_cluster, kubectl
from tests.helpers.podrunner import PodRunner

CHART = Path(__file__).resolve().parents[2] / "charts" / "glm5"
pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="pods need root and unshare"),
]


async def _until(check, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        result = check()
        if result:
            return result
        await asyncio.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


async def _scale(server: str, replicas: int) -> None:
    await asyncio.to_thread(kubectl, server, "scale", "glm5deployment/tiny", f"--replicas={replicas}")


def _healthy_workers(router: str) -> list[str]:
    try:
        with urllib.request.urlopen(f"http://{router}:8000/health", timeout=5) as r:
            health = json.load(r)
    except urllib.error.HTTPError as exc:
        health = json.load(exc)
    return [w["address"] for w in health["workers"] if w["healthy"]]


async def _workers_used(router: str, n: int) -> set[str]:
    request = router_pb2.RouterGenerateRequest(
        request=worker_pb2.GenerateRequest(prompt="1 + 1", sampling=sampling(max_new_tokens=2, temperature=0))
    )
    async with grpc.aio.insecure_channel(f"{router}:50050") as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        return {r.worker for _ in range(n) async for r in stub.Generate(request, timeout=60) if r.worker}


async def test_cpu_example_becomes_ready_answers_and_scales(tmp_path: Path) -> None:
    example = CHART / "examples" / "cpu.yaml"
    doc = yaml.safe_load(example.read_text())
    shutil.copytree(SHIPPED_MODEL, tmp_path / "claims" / doc["spec"]["model"]["pvcName"])  # the claim's content
    async with emulated_cluster() as emulator:
        server = str(emulator.url).rstrip("/")
        kube = Kube.for_server(server)
        operator = await OperatorThread.start(OperatorConfig(retry_delay_s=0.3), server)
        runner = PodRunner(emulator, kube, "default", tmp_path)
        try:
            await asyncio.to_thread(kubectl, server, "apply", "-f", str(example))
            await runner.start()

            def ready() -> bool:
                obj = emulator.objects["glm5.ai/v1alpha1/glm5deployments", "default", "tiny"].raw
                conds = (obj.get("status") or {}).get("conditions") or []
                return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

            await _until(ready, 240, "the GLM5Deployment to be Ready")
            client = openai.AsyncOpenAI(base_url=f"http://{runner.address('tiny-router')}:8000/v1", api_key="none",
                                        max_retries=3)  # fmt: skip
            stream = await client.chat.completions.create(
                model="glm5-tiny", messages=[{"role": "user", "content": "What is 12 + 30?"}], max_tokens=64,
                temperature=0, stream=True, extra_body={"thinking": {"type": "enabled"}},  # it reasons, then answers
            )  # fmt: skip
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert "42" in text

            # `kubectl scale` (the scale subresource) to two replicas: a second worker pod; the router uses it too
            router = runner.address("tiny-router")
            await _scale(server, 2)
            await _until(lambda: len(_healthy_workers(router)) == 2, 180, "the router to see two workers")
            assert len(await _workers_used(router, 8)) == 2
            await _scale(server, 1)  # and back: the second pod goes, the router drops it
            await _until(lambda: len(_healthy_workers(router)) == 1 and "tiny-worker-1" not in runner.pods, 120,
                         "one worker again")  # fmt: skip
        finally:
            await runner.stop()
            await operator.stop()
