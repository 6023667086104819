"""Weight sync into multi-rank replicas (issue 35, item 5): a 2-rank sharded trainer sends its weights in buckets
over a gloo group per engine replica (the collective transport), into a tensor-parallel-2 worker and into a
replica over two `glm5 worker` processes (--nnodes 2, whose second host has no gRPC server and cannot see the
first host's weights root: its own mount namespace hides it). The published version then goes to the same
engines by file: from disk into the first, streamed (PushWeights) into the two-host replica, whose first host
forwards the second host's ranks their parts. Every way gives exactly the same tokens, and a trainer that dies
mid-sync changes nothing on any rank."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from glm5.client import sampling, worker_stub
from glm5.model.presets import init_model
from glm5.security import admin_metadata
from glm5.v1 import worker_pb2
from glm5_trainer.versions import sync_workers

from tests.helpers.procs import ADMIN_TOKEN, INTERNAL_ENV, INTERNAL_TOKEN, admin_flags, free_port, start_worker, stop

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
FLAGS = ("--max-model-len", "512", "--kv-cache-bytes", "16MiB", "--block-size", "16", "--enforce-eager",
         "--internal-token-env", INTERNAL_ENV)  # fmt: skip
PROMPT = [5 + (i * 7) % 200 for i in range(23)]


def _greedy(target: str) -> tuple[list[int], list[float], int]:
    with grpc.insecure_channel(target) as ch:
        stub = worker_stub(ch, INTERNAL_TOKEN)
        greedy = sampling(max_new_tokens=10, temperature=0, ignore_eos=True)
        req = worker_pb2.GenerateRequest(prompt_token_ids=PROMPT, return_logprobs=True, sampling=greedy)
        ids, logps, versions = [], [], set()
        for r in stub.Generate(req, timeout=120):
            ids += r.token_ids
            logps += [lp.logprob for lp in r.logprobs]
            versions.add(r.weight_version)
        assert len(versions) == 1
        return ids, logps, versions.pop()


def _update_from(target: str, version: int, location: Path) -> None:
    with grpc.insecure_channel(target) as ch:
        worker_stub(ch, INTERNAL_TOKEN).UpdateWeights(
            worker_pb2.UpdateWeightsRequest(version=version, location=str(location)),
            metadata=admin_metadata(ADMIN_TOKEN), timeout=120,
        )  # fmt: skip


def _trainer(policy: Path, engines: dict[str, int], version: int, out: Path, *extra: str) -> list[int]:
    """Two trainer ranks (torchrun's variables); rank 0's exit code first. Fails on a hang."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        targets = [f"--engine={e}={tp}" for e, tp in engines.items()]
        argv = [sys.executable, "-m", "tests.helpers.sync_trainer", "--policy", str(policy), "--version",
                str(version), "--out", str(out), *targets, *extra]  # fmt: skip
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env))
    deadline = time.monotonic() + 240
    try:
        code0 = procs[0].wait(timeout=240)
        if code0 != 0:
            return [code0]
        return [code0, procs[1].wait(timeout=max(deadline - time.monotonic(), 1))]
    finally:
        for p in procs:
            p.kill()


def test_collective_sync_into_tensor_parallel_and_two_host_replicas(tiny_model: Path, tmp_path: Path) -> None:
    policy = init_model(tmp_path / "trained", preset="tiny", seed=1)  # what the trainer holds: other weights
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, policy / name)
    roots = tmp_path / "roots"
    roots.mkdir()
    tp2, tp2_target = start_worker(tiny_model, *FLAGS, "-tp", "2", *admin_flags(roots), log=tmp_path / "tp2.log")
    rdzv = str(free_port())
    two = ("-tp", "2", "--nnodes", "2", "--master-port", rdzv, "--master-addr", "127.0.0.1")
    env = {**os.environ, INTERNAL_ENV: INTERNAL_TOKEN.value}
    with open(tmp_path / "node1.log", "w") as log1:
        hide = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', str(roots)]
        argv = [
            *hide,
            sys.executable,
            "-m",
            "glm5_cli",
            "worker",
            "--model",
            str(tiny_model),
            "--node-rank",
            "1",
            *two,
            *FLAGS,
        ]
        node1 = subprocess.Popen(argv, stdout=log1, stderr=subprocess.STDOUT, env=env)
    try:
        node0, node0_target = start_worker(tiny_model, *FLAGS, *two, *admin_flags(roots), log=tmp_path / "node0.log")
        engines = {tp2_target: 2, node0_target: 2}
        try:
            before = {e: _greedy(e) for e in engines}
            assert all(v == 0 for _, _, v in before.values())

            # a trainer that dies after the first bucket: no rank of any replica swaps anything
            assert _trainer(policy, engines, 1, tmp_path / "dead", "--die-after-buckets", "1")[0] == 3
            time.sleep(1)
            for e in engines:
                ids, logps, version = _greedy(e)
                assert (ids, version) == (before[e][0], 0), "a half-received sync changed the served weights"
                assert _close(logps, before[e][1])

            out = tmp_path / "run"
            assert _trainer(policy, engines, 1, out, "--publish") == [0, 0]
            summary = json.loads((out / "sync.json").read_text())
            assert summary["errors"] == {} and set(summary["seconds"]) == set(engines)
            assert summary["buckets"] > 3  # really bucketed: 64 KiB at a time
            synced = {e: _greedy(e) for e in engines}
            published = out / "actor_synced" / "v000001"
            assert published.is_dir()
            for e in engines:
                assert synced[e][2] == 1 and synced[e][0] != before[e][0]
            assert synced[tp2_target][0] == synced[node0_target][0]
            _update_from(tp2_target, 2, _into_root(published, roots, tp2_target))  # the published files, from disk
            pushed = asyncio.run(sync_workers([node0_target], 2, published, admin_token=ADMIN_TOKEN,
                                              transport="stream", internal_token=INTERNAL_TOKEN))  # fmt: skip
            assert set(pushed) == {node0_target}
            for e in engines:
                ids, logps, version = _greedy(e)
                assert version == 2
                assert ids == synced[e][0]
                assert _close(logps, synced[e][1])
            assert node1.poll() is None  # the second host took its ranks' part without a file or a server
            host1 = (tmp_path / "node1.log").read_text()
            assert "weights v2 swapped in" in host1
            # each engine rank received only what its shard reads: about half of each split tensor, the
            # replicated ones whole (norms, router, indexer: much of this tiny model), from the trainer (twice:
            # the dead sync and v1) and from host 0 (v2)
            received = [int(a) / int(b) for a, b in re.findall(r"receives (\d+) of the version's (\d+) bytes", host1)]
            assert len(received) == 3 and all(0.4 < r < 0.7 for r in received), received
            assert not list((roots / ".pushed").iterdir())  # the staged copy is gone
        finally:
            assert stop(node0) == 0
        assert node1.wait(timeout=30) == 0
    finally:
        for proc in (tp2, node1):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _close(a: list[float], b: list[float]) -> bool:
    """float32 log-probs of the same weights (a prefix-cache hit may sum in another order)."""
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def _into_root(published: Path, roots: Path, engine: str) -> Path:
    """A copy under the engines' weights root (UpdateWeights reads only there)."""
    target = roots / engine.replace(":", "_")
    shutil.copytree(published, target)
    return target
