"""`glm5 worker --tensor-parallel-size N` as real processes (rank 0 serving gRPC, followers it started itself,
gloo between them): the same greedy tokens as one device, per-rank stats, clear start-up errors, and a replica
that goes down loudly and quickly, never hangs, when a follower is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from glm5.client import sampling
from glm5.v1 import worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.procs import free_port, start_worker, stop

ARGS = ("--kv-cache-bytes", "32MiB", "--max-model-len", "1024", "--block-size", "16", "--collective-timeout", "10")
pytestmark = pytest.mark.slow


def followers_of(pid: int) -> list[int]:
    """The rank processes `pid` started (from /proc; no psutil here), not multiprocessing's resource tracker."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    # 300 tokens: longer than the tiny preset's index_topk (256), so top-k selection really drops tokens
    return [torch.randint(20, 1000, (n,), generator=g).tolist() for n in (300, 40, 7)]


def greedy(target: str) -> list[list[int]]:
    with grpc.insecure_channel(target) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        out = []
        for ids in prompts():
            req = worker_pb2.GenerateRequest(
                prompt_token_ids=ids, sampling=sampling(temperature=0.0, max_new_tokens=24, ignore_eos=True)
            )
            out.append([t for r in stub.Generate(req, timeout=120) for t in r.token_ids])
        return out


@pytest.fixture(scope="module")
def single_device_tokens(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    log = tmp_path_factory.mktemp("tp1") / "worker.log"
    proc, target = start_worker(tiny_model, *ARGS, log=log)
    try:
        return greedy(target)
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]


@pytest.mark.parametrize("extra", [("--tensor-parallel-size", "2"), ("-tp", "4"), ("-tp", "2", "--no-expert-parallel")])
def test_replica_generates_what_one_device_does(
    tiny_model: Path, tmp_path: Path, single_device_tokens: list[list[int]], extra: tuple[str, ...]
) -> None:
    log = tmp_path / "worker.log"
    proc, target = start_worker(tiny_model, *ARGS, *extra, log=log)
    try:
        size = int(extra[1])
        assert len(followers_of(proc.pid)) == size - 1  # ranks 1..N-1 are processes of their own
        assert greedy(target) == single_device_tokens
        with grpc.insecure_channel(target) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            info = stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=10)
            assert info.tensor_parallel_size == size
            assert info.expert_parallel == ("--no-expert-parallel" not in extra)
            stats = stub.GetStats(worker_pb2.GetStatsRequest(), timeout=30)
        assert stats.world_size == size and [r.rank for r in stats.ranks] == list(range(size))
        # every rank holds a shard of the weights and a whole copy of the KV pool
        assert len({r.weight_bytes for r in stats.ranks}) == 1 and stats.ranks[0].weight_bytes > 0
        assert all(r.kv_bytes == stats.ranks[0].kv_bytes > 0 for r in stats.ranks)
        assert all(r.host_rss_bytes > 0 for r in stats.ranks)
    finally:
        code = stop(proc)
        assert code == 0, log.read_text()[-3000:]
    assert not followers_of(proc.pid)


def test_size_that_does_not_divide_fails_at_start_up(tiny_model: Path) -> None:
    cmd = [sys.executable, "-m", "glm5_cli", "worker", "--model", str(tiny_model), "--port", str(free_port()),
           "--host", "127.0.0.1", "--tensor-parallel-size", "8", *ARGS]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "does not divide num_attention_heads (4)" in done.stderr


def test_killed_follower_ends_requests_unavailable_and_the_worker_exits(tiny_model: Path, tmp_path: Path) -> None:
    timeout = 10.0  # --collective-timeout in ARGS
    log = tmp_path / "worker.log"
    proc, target = start_worker(tiny_model, *ARGS, "--tensor-parallel-size", "2", log=log)
    spawned = followers_of(proc.pid)
    assert len(spawned) == 1
    try:
        errors: list[grpc.StatusCode] = []
        first_token = threading.Event()
        ended_at: list[float] = []

        def long_request() -> None:
            with grpc.insecure_channel(target) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                req = worker_pb2.GenerateRequest(
                    prompt="What is 1 + 2?", sampling=sampling(temperature=0.0, max_new_tokens=900, ignore_eos=True)
                )
                try:
                    for _ in stub.Generate(req, timeout=4 * timeout):
                        first_token.set()
                except grpc.RpcError as exc:
                    errors.append(exc.code())
                ended_at.append(time.monotonic())

        client = threading.Thread(target=long_request)
        client.start()
        assert first_token.wait(60), log.read_text()[-3000:]
        killed_at = time.monotonic()
        for pid in spawned:
            os.kill(pid, signal.SIGKILL)
        client.join(timeout=2 * timeout)
        assert not client.is_alive(), "the request hung"
        assert errors == [grpc.StatusCode.UNAVAILABLE]
        assert ended_at[0] - killed_at <= timeout
        code = proc.wait(timeout=2 * timeout)  # raises TimeoutExpired on a hang
        assert code != 0
        assert time.monotonic() - killed_at <= 2 * timeout
        assert "replica lost" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_health_reports_not_serving_once_the_replica_is_lost(tiny_model: Path, tmp_path: Path) -> None:
    """Killed while idle: the heartbeat finds out, health turns NOT_SERVING (probes fail), the worker exits 1."""
    log = tmp_path / "worker.log"
    proc, target = start_worker(tiny_model, *ARGS, "--tensor-parallel-size", "2", log=log)
    try:
        for pid in followers_of(proc.pid):
            os.kill(pid, signal.SIGKILL)
        statuses = []
        deadline = time.monotonic() + 20
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    statuses.append(stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
                except grpc.RpcError:
                    break
                time.sleep(0.05)
        assert proc.wait(timeout=20) == 1, log.read_text()[-3000:]
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_replica_over_two_hosts(tiny_model: Path, tmp_path: Path, single_device_tokens: list[list[int]]) -> None:
    """What the operator renders for a replica larger than a node: one `glm5 worker` per host, the second with
    --node-rank 1 running follower ranks only (no gRPC server) and reaching rank 0 at --master-addr."""
    rdzv = str(free_port())
    two = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", rdzv, "--master-addr", "127.0.0.1")
    second_log = tmp_path / "node1.log"
    with open(second_log, "w") as out:
        second = subprocess.Popen(
            [sys.executable, "-m", "glm5_cli", "worker", "--model", str(tiny_model), "--node-rank", "1", *two, *ARGS],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        first, target = start_worker(tiny_model, *two, *ARGS, log=tmp_path / "node0.log")
        try:
            assert greedy(target) == single_device_tokens
            assert second.poll() is None
        finally:
            assert stop(first) == 0
        # rank 0 stopped the replica: the other host's ranks exit cleanly
        assert second.wait(timeout=30) == 0, second_log.read_text()[-3000:]
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()


def test_follower_never_outlives_rank_0(tiny_model: Path, tmp_path: Path) -> None:
    proc, _ = start_worker(tiny_model, *ARGS, "--tensor-parallel-size", "2", log=tmp_path / "worker.log")
    (follower,) = followers_of(proc.pid)
    proc.kill()  # SIGKILL: rank 0 gets no chance to stop its followers
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(follower):
        time.sleep(0.1)
    assert not _alive(follower), "a follower outlived its rank 0"


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a parent that may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
