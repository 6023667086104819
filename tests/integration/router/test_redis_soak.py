"""The shared Redis queue under the waits and failures an operator meets: tokens more than 5 s apart (longer than
redis-py's socket timeout), requests queued behind others for longer than that, clients that give up, a Redis
restart and a worker SIGKILL under load. Wanted: zero 5xx other than a clean 503, zero lost accepted requests, and
the queue and the workers drained afterwards (an abandoned request is cancelled, not run for nobody)."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
import redis
from glm5.v1 import worker_pb2, worker_pb2_grpc

from tests.helpers.procs import start_redis, start_router, start_scripted_worker, stop


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    proc, url = start_redis(tmp_path)
    state = {"proc": proc, "url": url, "port": int(url.rsplit(":", 1)[1].split("/")[0]), "dir": tmp_path}
    try:
        yield state
    finally:
        stop(state["proc"])


def _complete(base: str, prompt: str, max_tokens: int, timeout: float = 90) -> tuple[int, str]:
    try:
        resp = httpx2.post(base + "/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=timeout)
    except httpx2.HTTPError as exc:
        return -1, type(exc).__name__
    text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text[:200]
    return resp.status_code, text


def _stream_gaps(base: str, prompt: str) -> tuple[int, float]:
    """A streamed completion: (status, the longest gap between two events in seconds)."""
    gaps, last = [0.0], time.monotonic()
    with httpx2.stream("POST", base + "/completions", timeout=90,
                       json={"prompt": prompt, "max_tokens": 3, "stream": True}) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                assert '"error"' not in line, line
        return resp.status_code, max(gaps)


def _running(worker: str) -> int:
    with grpc.insecure_channel(worker) as ch:
        return int(worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=5).num_running)


def _drained(url: str, workers: list[str], timeout: float = 15.0) -> bool:
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.zcard("queue:short") + r.zcard("queue:long") == 0 and all(_running(w) == 0 for w in workers):
            return True
        time.sleep(0.2)
    return False


def test_waits_longer_than_the_socket_timeout_are_served(redis_server: dict[str, Any], tmp_path: Path) -> None:
    """Two requests at a time per worker: twelve queue for up to ~20 s, four have 6 s between two tokens."""
    wproc, worker = start_scripted_worker()
    router, _, base = start_router([worker], "--redis-url", redis_server["url"], "--redis-claims-per-worker", "2",
                                   log=tmp_path / "router.log")  # fmt: skip
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            streams = [pool.submit(_stream_gaps, base, f"PAUSE stream {i}") for i in range(2)]
            calls = [pool.submit(_complete, base, f"{'PAUSE' if i % 4 == 0 else 'SLOW'} {i}", 40) for i in range(14)]
            results = [f.result() for f in calls]
            gaps = [f.result() for f in streams]
        assert [s for s, _ in results] == [200] * 14, results
        assert all(text.count("token") in (3, 40) for _, text in results)  # PAUSE: 3 chunks, SLOW: 40
        assert [s for s, _ in gaps] == [200, 200] and min(g for _, g in gaps) > 5.0
        assert _drained(redis_server["url"], [worker])
        assert "Traceback" not in (tmp_path / "router.log").read_text()
    finally:
        stop(router)
        stop(wproc)


def test_a_client_that_gives_up_is_cancelled_queued_or_running(redis_server: dict[str, Any]) -> None:
    wproc, worker = start_scripted_worker()
    router, _, base = start_router([worker], "--redis-url", redis_server["url"], "--redis-claims-per-worker", "1")
    r = redis.Redis.from_url(redis_server["url"])
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            # each of these would run ~12 s (240 tokens, 50 ms apart); the clients leave after 1.5 s: one of them
            # running, the rest queued behind it
            gave_up = [pool.submit(_complete, base, f"SLOW {i}", 240, 1.5) for i in range(6)]
            assert all(f.result()[0] == -1 for f in gave_up)
        assert _drained(redis_server["url"], [worker], timeout=10), "an abandoned request kept running or queued"
        assert r.zcard("queue:short") == 0
        assert _complete(base, "after", 3) == (200, " token" * 3)
    finally:
        stop(router)
        stop(wproc)


def test_no_worker_is_a_503_after_the_no_worker_timeout(redis_server: dict[str, Any], tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"_unhealthy": True}))
    wproc, worker = start_scripted_worker(stats)
    router, _, base = start_router([worker], "--redis-url", redis_server["url"], "--no-worker-timeout", "2")
    try:
        start = time.monotonic()
        status, text = _complete(base, "nobody home", 3)
        assert status == 503 and "no worker" in text, text
        assert time.monotonic() - start < 8
        assert redis.Redis.from_url(redis_server["url"]).zcard("queue:short") == 0  # it left the queue
        stats.write_text("{}")
        deadline = time.monotonic() + 10
        while (status := _complete(base, "back", 3)[0]) != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status == 200
    finally:
        stop(router)
        stop(wproc)


def test_a_redis_restart_under_load_gives_only_clean_503s_and_recovers(redis_server: dict[str, Any],
                                                                       tmp_path: Path) -> None:  # fmt: skip
    wproc, worker = start_scripted_worker()
    router, _, base = start_router([worker], "--redis-url", redis_server["url"], log=tmp_path / "router.log")
    statuses: list[int] = []
    stop_load = False

    def load(i: int) -> None:
        while not stop_load:
            statuses.append(_complete(base, f"SLOW load {i}", 10, timeout=60)[0])

    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            workers = [pool.submit(load, i) for i in range(6)]
            time.sleep(2)
            redis_server["proc"].send_signal(signal.SIGKILL)
            redis_server["proc"].wait()
            time.sleep(2)  # requests meanwhile: retried, then 503
            redis_server["proc"], _ = start_redis(redis_server["dir"], redis_server["port"])
            time.sleep(4)
            stop_load = True
            for f in workers:
                f.result()
        assert statuses and set(statuses) <= {200, 503}, sorted(set(statuses))
        assert _complete(base, "after the restart", 3) == (200, " token" * 3)  # no router restart needed
        assert _drained(redis_server["url"], [worker])
    finally:
        stop_load = True
        stop(router)
        stop(wproc)


def test_a_worker_sigkill_under_load_loses_nothing(redis_server: dict[str, Any], tmp_path: Path) -> None:
    (kproc, killed), (sproc, survivor) = start_scripted_worker(), start_scripted_worker()
    router, _, base = start_router([killed, survivor], "--redis-url", redis_server["url"], "--no-worker-timeout", "5")
    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            calls = [pool.submit(_complete, base, f"SLOW {i}", 30) for i in range(36)]
            time.sleep(1.0)
            kproc.send_signal(signal.SIGKILL)
            results = [f.result() for f in calls]
        statuses = [s for s, _ in results]
        assert set(statuses) <= {200, 503} and statuses.count(200) >= 24, results  # every one answered
        assert all(text == " token" * 30 for s, text in results if s == 200)
        assert _drained(redis_server["url"], [survivor])
    finally:
        stop(router)
        stop(kproc)
        stop(sproc)


def test_the_relay_never_blocks_past_the_socket_timeout() -> None:
    """The settings cannot be combined into a read that outlives its socket."""
    from glm5_router.scheduling.redis_queue import RedisSettings

    assert RedisSettings("redis://x").block_s < RedisSettings("redis://x").socket_timeout_s
    with pytest.raises(ValueError, match="shorter"):
        RedisSettings("redis://x", block_s=10, socket_timeout_s=5)
