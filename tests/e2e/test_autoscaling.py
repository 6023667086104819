"""A GLM5Deployment with spec.autoscaling under load, without a cluster: the real operator renders the HPA (no KEDA
here, so backend auto picks it), a real Prometheus scrapes the router pod, and tests/helpers/autoscaler.py runs the
HPA controller's algorithm on prometheus-adapter's rules from the chart. Load makes requests wait: a second replica
comes, serves, and goes again once the load falls, draining, with no request failing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import yaml

from tests.e2e.conftest import EXAMPLES, Cluster, needs_pods
from tests.helpers.autoscaler import Autoscaler, Prometheus

pytestmark = [pytest.mark.asyncio, needs_pods]
DEPLOYMENTS = "glm5.ai/v1alpha1/glm5deployments"


async def test_queue_depth_scales_out_and_back_in_without_a_failed_request(cluster: Cluster, tmp_path: Path) -> None:
    manifest = yaml.safe_load((EXAMPLES / "cpu-autoscaling.yaml").read_text())
    manifest["spec"]["autoscaling"]["scaleDownStabilizationSeconds"] = 5  # a test's patience, not a cluster's
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(manifest))
    await cluster.fill_demo_claims()
    await cluster.kubectl("apply", "-f", str(path))
    await cluster.until(lambda: cluster.condition(DEPLOYMENTS, "tiny", "Ready").get("status") == "True", 240,
                        "the GLM5Deployment to be Ready")  # fmt: skip
    status = lambda: cluster.get(DEPLOYMENTS, "tiny")["status"]  # noqa: E731
    assert status()["autoscaler"] == "HorizontalPodAutoscaler/tiny-autoscaler"
    prometheus = await asyncio.to_thread(Prometheus, tmp_path / "prometheus")
    autoscaler = Autoscaler(cluster.kube, "default", prometheus)
    await autoscaler.start()
    router = cluster.runner.address("tiny-router")
    client = openai.AsyncOpenAI(base_url=f"http://{router}:8000/v1", api_key="none", max_retries=0)
    served = manifest["spec"]["model"]["servedName"]
    done: list[int] = []
    failed: list[str] = []

    async def user(i: int, stop: asyncio.Event, tokens: int) -> None:
        while not stop.is_set():
            try:
                stream = await client.completions.create(
                    model=served, prompt=f"user {i} asks {len(done)}", max_tokens=tokens, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                got = sum([len(c.choices[0].text) > 0 async for c in stream if c.choices])
                done.append(got)
            except openai.OpenAIError as exc:
                failed.append(f"user {i}: {exc}")

    async def wait(check: Callable[[], object], timeout: float, what: str) -> None:
        try:
            await cluster.until(check, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nautoscaler: {autoscaler.describe()}") from None

    users: list[asyncio.Task[None]] = []
    try:
        # 12 users on a replica that runs 4 sequences at once: ~8 wait, 4 per replica over the target of 2
        heavy, light = asyncio.Event(), asyncio.Event()
        users += [asyncio.create_task(user(i, heavy, 48)) for i in range(12)]
        await wait(lambda: cluster.get(DEPLOYMENTS, "tiny")["spec"]["workers"].get("replicas") == 2, 120,
                            "the autoscaler to ask for 2 replicas")  # fmt: skip
        await wait(lambda: status().get("ready") == "2/2", 180, "READY 2/2")
        second = f'worker="{cluster.runner.pods["tiny-worker-1"].ip}:50051"'  # the router knows workers by address
        await wait(lambda: (prometheus.query(f"max(glm5_worker_generated_tokens_total{{{second}}})") or 0) > 0,
                            60, "the second replica to serve")  # fmt: skip
        heavy.set()
        # two users go on (nothing waits): the autoscaler scales in while their requests run
        users += [asyncio.create_task(user(100 + i, light, 24)) for i in range(2)]
        await wait(lambda: cluster.get(DEPLOYMENTS, "tiny")["spec"]["workers"].get("replicas") == 1, 120,
                            "the autoscaler to scale in")  # fmt: skip
        before = len(done)
        await wait(lambda: "tiny-worker-1" not in cluster.runner.pods and status().get("ready") == "1/1", 120,
                            "one replica again")  # fmt: skip
        await wait(lambda: len(done) >= before + 4, 60, "requests served after the scale-in")
        light.set()
        await asyncio.wait_for(asyncio.gather(*users), 120)
    finally:
        for task in users:
            task.cancel()
        await autoscaler.stop()
        with contextlib.suppress(Exception):
            await client.close()
        prometheus.stop()
    assert not failed, failed[:5]
    assert [(d[1], d[2]) for d in autoscaler.decisions] == [(1, 2), (2, 1)], autoscaler.decisions
    assert len(done) > 20 and all(n > 0 for n in done)
