"""A worker that turns SERVING is in rotation within a poll or two, however long it was away (issue 34: after a
worker loaded for minutes, the router took 2m16s to take it in: its channel's reconnect backoff had grown toward
gRPC's 120 s cap while nothing listened)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
from glm5.model.presets import default_model_path
from glm5.v1 import router_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.procs import free_port, start_router, stop

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
ABSENT_S = 25.0  # by then gRPC's default backoff waits ~10-25 s between attempts (1 s x 1.6^n, jittered)


def _serving_at(target: str, service: str, deadline: float) -> float:
    """When `target`'s health says SERVING for `service` (polled every 0.05 s on a fresh channel each time)."""
    request = health_pb2.HealthCheckRequest(service=service)
    while time.monotonic() < deadline:
        with grpc.insecure_channel(target) as channel:
            try:
                if health_pb2_grpc.HealthStub(channel).Check(request, timeout=1).status == 1:
                    return time.monotonic()
            except grpc.RpcError:
                pass
        time.sleep(0.05)
    raise TimeoutError(f"{target} {service or '(process)'} not serving")


def test_router_takes_a_late_worker_in_within_two_seconds(tmp_path: Path) -> None:
    port = free_port()
    worker_target = f"127.0.0.1:{port}"
    # the real default stats interval (1 s), not the helper's 0.2 s
    router, router_target, _ = start_router([worker_target], "--stats-interval", "1", log=tmp_path / "router.log")
    worker = None
    try:
        time.sleep(ABSENT_S)  # the router polls a worker that is not there yet
        cmd = [sys.executable, "-m", "glm5_cli", "worker", "--model", str(default_model_path()), "--port", str(port),
               "--kv-cache-bytes", "64MiB", "--max-model-len", "2048"]  # fmt: skip
        with open(tmp_path / "worker.log", "w") as out:
            worker = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        serving = _serving_at(worker_target, "", deadline)
        routed = _serving_at(router_target, ROUTER_SERVICE, deadline)  # the router's readiness: a worker answered
        assert routed - serving < 2.0, f"in rotation {routed - serving:.1f} s after the worker served"
    finally:
        stop(router)
        if worker is not None:
            stop(worker)
