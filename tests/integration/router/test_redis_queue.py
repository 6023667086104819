"""The shared Redis queue with a real redis-server: two routers share it, and requests queued when a router
stops complete exactly once after a restart (the client gets the output by sending its request id again)."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
import redis
from glm5.v1 import worker_pb2, worker_pb2_grpc

from tests.helpers.procs import start_redis, start_router, start_scripted_worker, stop


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    proc, url = start_redis(tmp_path)
    try:
        yield url
    finally:
        stop(proc)


def _served(worker: str) -> int:
    with grpc.insecure_channel(worker) as ch:
        return int(worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.GetStatsRequest()).generated_tokens_total)


def _client(base: str, request_id: str | None = None) -> openai.OpenAI:
    headers = {"X-Request-Id": request_id} if request_id else None
    return openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60, default_headers=headers)


def test_two_routers_share_one_queue(redis_url: str, tmp_path: Path) -> None:
    wproc, worker = start_scripted_worker(tmp_path / "stats.json")
    a, _, base_a = start_router([worker], "--redis-url", redis_url)
    b, _, base_b = start_router([worker], "--redis-url", redis_url)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_client(base).completions.create, model="glm5-scripted", prompt=f"p{i}",
                                   max_tokens=3) for i, base in enumerate([base_a, base_b] * 6)]  # fmt: skip
            assert [f.result().choices[0].text for f in futures] == [" token" * 3] * 12
        assert _served(worker) == 12
        assert redis.Redis.from_url(redis_url).zcard("queue:short") == 0
    finally:
        stop(a)
        stop(b)
        stop(wproc)


def test_queued_requests_survive_a_router_restart_and_complete_exactly_once(redis_url: str, tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text("{}")
    wproc, worker = start_scripted_worker(stats)
    router, _, base = start_router([worker], "--redis-url", redis_url, log=tmp_path / "a.log")
    r = redis.Redis.from_url(redis_url)
    ids = [f"req-restart-{i}" for i in range(3)]
    try:
        stats.write_text(json.dumps({"_unhealthy": True}))  # no worker: requests wait in the shared queue
        time.sleep(1.0)
        pool = concurrent.futures.ThreadPoolExecutor(3)
        waiting = [pool.submit(_client(base, rid).completions.create, model="glm5-scripted", prompt=f"job {i}",
                               max_tokens=4) for i, rid in enumerate(ids)]  # fmt: skip
        deadline = time.monotonic() + 10
        while r.zcard("queue:short") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.zcard("queue:short") == 3
        stop(router)  # the router goes away with the requests queued
        for f in waiting:
            with pytest.raises(openai.APIError):
                f.result(timeout=30)
        pool.shutdown()
        assert r.zcard("queue:short") == 3  # still there
        stats.write_text("{}")
        router, _, base = start_router([worker], "--redis-url", redis_url, log=tmp_path / "b.log")
        for i, rid in enumerate(ids):  # the clients come back with their request ids
            out = _client(base, rid).completions.create(model="glm5-scripted", prompt=f"job {i}", max_tokens=4)
            assert out.choices[0].text == " token" * 4
        assert _served(worker) == 3  # each ran exactly once
        again = _client(base, ids[0]).completions.create(model="glm5-scripted", prompt="job 0", max_tokens=4)
        assert again.choices[0].text == " token" * 4 and _served(worker) == 3  # a repeat attaches, never reruns
        assert r.zcard("queue:short") == 0
    finally:
        stop(router)
        stop(wproc)
