"""An RLJob from `kubectl apply` to trained weights, without a cluster (issue 18): the chart's examples/rljob.yaml
on the cpu.yaml deployment's workers, its trainer and gateway run as pods by the test pod runner. The trainer reads
its policy and dataset from the claims examples/demo-data.yaml filled, and sends every version to the workers by
collective (its ranks' shards straight into the workers' ranks, no file). The trainer runs as two pods of two
ranks each (world 4) on two nodes: pod 1 finds pod 0's rendezvous by its stable name, and both write one DCP
checkpoint and each version on the ReadWriteMany claim they share."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import yaml
from glm5.security import INTERNAL_TOKEN_METADATA
from glm5.v1 import worker_pb2, worker_pb2_grpc

from tests.e2e.conftest import EXAMPLES, Cluster, needs_pods

pytestmark = [pytest.mark.asyncio, needs_pods]
DEPLOYMENTS, RLJOBS = "glm5.ai/v1alpha1/glm5deployments", "glm5.ai/v1alpha1/rljobs"


async def _weight_version(address: str, token: str) -> int:
    """What a worker serves, asked with its deployment's internal token (nothing answers without it)."""
    async with grpc.aio.insecure_channel(address) as ch:
        info = await worker_pb2_grpc.WorkerStub(ch).GetModelInfo(
            worker_pb2.GetModelInfoRequest(), timeout=10, metadata=((INTERNAL_TOKEN_METADATA, token),)
        )
    return int(info.weight_version)


@pytest.mark.pod_runner(nodes=2)  # pods placed on two nodes in turn
async def test_rljob_example_trains_and_the_workers_serve_its_weights(cluster: Cluster, tmp_path: Path) -> None:
    await cluster.fill_demo_claims()
    await cluster.kubectl("apply", "-f", str(EXAMPLES / "cpu.yaml"))
    await cluster.until(lambda: cluster.condition(DEPLOYMENTS, "tiny", "Ready").get("status") == "True", 240,
                        "the GLM5Deployment to be Ready")  # fmt: skip

    # The example as shipped, made small enough for two CPU cores: fewer and smaller steps, a version pushed
    # after every step, a held-out evaluation long enough for a progress poll to see the finished steps.
    job = yaml.safe_load((EXAMPLES / "rljob.yaml").read_text())
    name = job["metadata"]["name"]
    # and the trainer as two pods of two ranks (devices: 2 on cpu: two processes in each pod; nodes: 2), the
    # policy sharded over all four
    job["spec"]["trainer"] |= {"steps": 2, "syncEverySteps": 1, "groupSize": 4, "groupsPerStep": 2, "evalSize": 24,
                               "devices": 2, "nodes": 2}  # fmt: skip
    (tmp_path / "rljob.yaml").write_text(yaml.safe_dump(job))
    await cluster.kubectl("apply", "-f", str(tmp_path / "rljob.yaml"))

    seen: list[dict[str, object]] = []  # the job's progress while it runs (kubectl get rljob: STEPS, POLICY-VERSION)
    trainer_pods: dict[str, tuple[str, bool]] = {}  # trainer pod -> (its node, whether it was ever ready)

    def succeeded() -> bool:
        status = cluster.get(RLJOBS, name).get("status") or {}
        for i in range(2):
            pod = cluster.runner.pods.get(f"{name}-trainer-{i}")
            if pod is not None:
                trainer_pods[pod.name] = (pod.node, pod.ready or trainer_pods.get(pod.name, ("", False))[1])
        if status.get("phase") == "Running":
            seen.append(
                {k: status.get(k) for k in ("trainedSteps", "policyVersion", "lastSyncTime", "trainerWorldSize")}
            )
        return cluster.condition(RLJOBS, name, "Succeeded").get("status") == "True"

    await cluster.until(succeeded, 420, "the RLJob to succeed")
    steps_seen = [s["trainedSteps"] for s in seen if isinstance(s["trainedSteps"], int)]
    assert steps_seen == sorted(steps_seen), seen
    # before the job ended, its status already showed what the running trainer reported (how many steps a poll
    # catches mid-run is a race: a job this small trains its 2 steps faster than polls come on a loaded machine)
    assert any(isinstance(s["trainedSteps"], int) and isinstance(s["policyVersion"], int) for s in seen), seen
    assert any(s["trainerWorldSize"] == 4 for s in seen), seen
    # both pods ran, on two nodes, and both were ready: pod 0 serves the status, pod 1's first rank /healthz alone
    assert len(trainer_pods) == 2 and len({node for node, _ in trainer_pods.values()}) == 2, trainer_pods
    assert all(ready for _, ready in trainer_pods.values()), trainer_pods
    status = cluster.get(RLJOBS, name)["status"]
    assert status["phase"] == "Succeeded" and status["completedSteps"] == status["trainedSteps"] == 2
    version = status["policyVersion"]
    assert isinstance(version, int) and version >= 2  # at least one published version per step

    # the final checkpoint is on the claim the job names, at the path it names
    checkpoint = cluster.runner.workdir / "claims" / status["checkpoint"]["claim"] / status["checkpoint"]["path"]
    assert json.loads((checkpoint / "version.json").read_text())["steps"] == 2
    # written by the ranks of both pods on the claim they share: a file each (or more) and the index
    assert status["checkpoint"]["claim"] == f"checkpoints-{name}-trainer"
    assert (checkpoint / "model.safetensors.index.json").is_file() and (checkpoint / "tokenizer.json").is_file()
    assert len(list(checkpoint.glob("model-*.safetensors"))) >= 4

    # the rollout workers serve it: it reached them over the network, by collective from the trainer's ranks
    # (they mount neither the trainer's claim nor any other volume it wrote to)
    worker = cluster.runner.pods["tiny-worker-0"]
    assert await _weight_version(f"{worker.ip}:50051", cluster.secret("tiny-internal", "token")) == version
    log = (worker.dir / f"{worker.manifest['spec']['containers'][0]['name']}.log").read_text()
    assert f"weights v{version} from the trainer's group" in log, log[-2000:]
    assert not any(v.get("persistentVolumeClaim", {}).get("claimName") == status["checkpoint"]["claim"]
                   for v in worker.manifest["spec"]["volumes"])  # fmt: skip

    # the finished job's workloads scale to zero; the checkpoint stays
    await cluster.until(lambda: not any(p.startswith(f"{name}-") for p in cluster.runner.pods), 60,
                        "the job's pods to go")  # fmt: skip
    assert checkpoint.is_dir()
