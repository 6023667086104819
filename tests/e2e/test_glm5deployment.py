"""A GLM5Deployment from `kubectl apply` to streamed answers, without a cluster: the real operator (kopf) against
the kmock API emulator, and tests/helpers/podrunner.py running the pods it renders as real processes in their own
mount namespaces (issue 18)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import yaml
from glm5.client import sampling
from glm5.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from tests.e2e.conftest import EXAMPLES, Cluster, needs_pods

pytestmark = [pytest.mark.asyncio, needs_pods]
DEPLOYMENTS = "glm5.ai/v1alpha1/glm5deployments"


def _healthy_workers(router: str, even: bool = False) -> list[str]:
    """The workers the router reports healthy; `even`: only those it would pick as often as any other (breaker
    closed, no soft signal lowering their weight), as spreading sequential requests over them needs."""
    try:
        with urllib.request.urlopen(f"http://{router}:8000/health", timeout=5) as r:
            health = json.load(r)
    except urllib.error.HTTPError as exc:
        health = json.load(exc)
    return [w["address"] for w in health["workers"] if w["healthy"]
            and (not even or (w["breaker"] == "closed" and not w["degraded"]))]  # fmt: skip


async def _generate(router: str) -> str:
    """One short request through the router's gRPC API; the worker that served it."""
    request = router_pb2.RouterGenerateRequest(
        request=worker_pb2.GenerateRequest(prompt="1 + 1", sampling=sampling(max_new_tokens=2, temperature=0))
    )
    async with grpc.aio.insecure_channel(f"{router}:50050") as ch:
        replies = [r async for r in router_pb2_grpc.RouterStub(ch).Generate(request, timeout=60)]
    return next(r.worker for r in replies if r.worker)


async def test_cpu_example_becomes_ready_answers_scales_and_survives_a_killed_worker(cluster: Cluster) -> None:
    example = EXAMPLES / "cpu.yaml"
    served = yaml.safe_load(example.read_text())["spec"]["model"]["servedName"]
    await cluster.fill_demo_claims()
    await cluster.kubectl("apply", "-f", str(example))
    await cluster.until(lambda: cluster.condition(DEPLOYMENTS, "tiny", "Ready").get("status") == "True", 240,
                        "the GLM5Deployment to be Ready")  # fmt: skip
    assert cluster.get(DEPLOYMENTS, "tiny")["status"]["ready"] == "1/1"  # the READY column

    router = cluster.runner.address("tiny-router")
    client = openai.AsyncOpenAI(base_url=f"http://{router}:8000/v1", api_key="none", max_retries=3)
    stream = await client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": "What is 12 + 30?"}], max_tokens=64,
        temperature=0, stream=True, extra_body={"thinking": {"type": "enabled"}},  # it reasons, then answers
    )  # fmt: skip
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert "42" in text
    # the router reached the worker with the deployment's internal token; a caller without it is refused
    async with grpc.aio.insecure_channel(f"{cluster.runner.pods['tiny-worker-0'].ip}:50051") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await worker_pb2_grpc.WorkerStub(ch).GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert cluster.secret("tiny-internal", "token")

    # `kubectl scale` (the scale subresource) to two replicas: a second worker pod; the router uses it too
    await cluster.kubectl("scale", "glm5deployment/tiny", "--replicas=2")
    # a worker whose step-time jitter is over the breaker's threshold counts twice as loaded, so sequential requests
    # all go to the other one until its recent steps (30 s) are calm again: wait for both to weigh the same
    await cluster.until(lambda: len(_healthy_workers(router, even=True)) == 2, 180, "the router to see two workers")
    assert len({await _generate(router) for _ in range(8)}) == 2
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "tiny")["status"].get("ready") == "2/2", 60, "READY 2/2")

    # a worker's process dies: the pod is restarted, the deployment is Degraded until it is back, and requests
    # sent meanwhile are answered by the other replica
    cluster.runner.kill("tiny-worker-1")
    served_by: list[str] = []
    degraded = False
    deadline = asyncio.get_running_loop().time() + 120
    while asyncio.get_running_loop().time() < deadline:
        served_by.append(await _generate(router))
        degraded |= cluster.condition(DEPLOYMENTS, "tiny", "Degraded").get("status") == "True"
        if degraded and cluster.condition(DEPLOYMENTS, "tiny", "Ready").get("status") == "True":
            break
        await asyncio.sleep(0.2)
    assert degraded, "the deployment never reported Degraded"
    assert cluster.condition(DEPLOYMENTS, "tiny", "Ready").get("status") == "True", cluster.runner.describe()
    assert cluster.runner.pods["tiny-worker-1"].restarts == {"worker": 1}
    assert len(served_by) >= 3  # every request sent meanwhile got its answer (an error would have raised)

    await cluster.kubectl("scale", "glm5deployment/tiny", "--replicas=1")  # and back: the second pod goes
    await cluster.until(lambda: len(_healthy_workers(router)) == 1 and "tiny-worker-1" not in cluster.runner.pods,
                        120, "one worker again")  # fmt: skip
