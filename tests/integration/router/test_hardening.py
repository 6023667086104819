"""What a security tester and real OpenAI clients send, against a real router and worker: oversized requests are
refused with bounded memory while /health keeps answering, malformed numbers are 400s naming the field (never
500s), and the valid-but-unusual requests clients send are served."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import openai
import psutil
import pytest
from glm5.v1 import worker_pb2, worker_pb2_grpc

from tests.helpers.procs import start_router, start_scripted_worker, start_worker, stop

WORKER_FLAGS = ("--max-model-len", "1024", "--kv-cache-bytes", "16MiB")
MAX_RSS_GROWTH = 64 << 20


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("logs")
    worker, target = start_worker(tiny_model, *WORKER_FLAGS, log=logs / "worker.log")
    router, _, base = start_router([target], log=logs / "router.log")
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
    try:
        yield {"base": base, "worker": target, "worker_pid": worker.pid, "router_pid": router.pid, "client": client,
               "model": client.models.list().data[0].id, "logs": logs}  # fmt: skip
    finally:
        stop(router)
        stop(worker)


def _post(stack: dict[str, Any], path: str, body: Any, timeout: float = 60) -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx2.post(stack["base"].removesuffix("/v1") + path, content=content, timeout=timeout,
                       headers={"Content-Type": "application/json"})  # fmt: skip


class HealthWatch:
    """Polls /health in a thread while a request runs: the slowest answer must stay fast."""

    def __init__(self, base: str) -> None:
        self.url, self.times, self._stop = base.removesuffix("/v1") + "/health", [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx2.Client(timeout=5) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                http.get(self.url)
                self.times.append(time.perf_counter() - start)
                time.sleep(0.02)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.1)
        self._stop.set()
        self._thread.join()


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


@pytest.mark.parametrize("name", ["31MB-prompt", "31MB-tokenize", "100k-messages", "2M-char-prompt"])
def test_oversized_requests_are_refused_with_bounded_memory(stack: dict[str, Any], name: str) -> None:
    chat = {"model": stack["model"], "max_tokens": 4}
    path, body, status = {
        "31MB-prompt": ("/v1/completions", {**chat, "prompt": "1 + 2 = " * 3_900_000}, 413),
        "31MB-tokenize": ("/tokenize", {"prompt": "1 + 2 = " * 3_900_000}, 413),
        "100k-messages": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}] * 100_000},
                          400),
        "2M-char-prompt": ("/v1/completions", {**chat, "prompt": "x " * 999_000}, 400),  # under the body limit
    }[name]  # fmt: skip
    before = _rss(stack["router_pid"])
    content = json.dumps(body).encode()  # before the watch: encoding 31 MB holds this process's GIL for a while
    with HealthWatch(stack["base"]) as watch:
        resp = _post(stack, path, content)
    assert resp.status_code == status, resp.text[:300]
    assert resp.json()["error"]["message"]
    growth = _rss(stack["router_pid"]) - before
    assert growth < MAX_RSS_GROWTH, f"router RSS grew by {growth >> 20} MiB"
    assert max(watch.times) < 0.1, f"/health took {max(watch.times) * 1000:.0f} ms while the request was refused"


def test_a_60mb_tokenize_is_refused_by_the_worker(stack: dict[str, Any]) -> None:
    before = _rss(stack["worker_pid"])

    async def go() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(
            stack["worker"], options=[("grpc.max_send_message_length", 1 << 30)]
        ) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await worker_pb2_grpc.WorkerStub(ch).Tokenize(worker_pb2.TokenizeRequest(text="x" * (60 << 20)))
            return err.value

    err = asyncio.run(go())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the receive limit: never read in
    growth = _rss(stack["worker_pid"]) - before
    assert growth < MAX_RSS_GROWTH, f"worker RSS grew by {growth >> 20} MiB"

    async def long_text() -> grpc.aio.AioRpcError:  # under the message limit, but more tokens than the model holds
        async with grpc.aio.insecure_channel(stack["worker"]) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await worker_pb2_grpc.WorkerStub(ch).Tokenize(worker_pb2.TokenizeRequest(text="1 + 2 " * 1_000_000))
            return err.value

    err = asyncio.run(long_text())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens" in (err.details() or "")


@pytest.mark.parametrize("path,extra,field", [
    ("/v1/chat/completions", {"max_tokens": 2147483648}, "max_tokens"),
    ("/v1/chat/completions", {"seed": 18446744073709551616}, "seed"),
    ("/v1/chat/completions", {"top_k": 2147483648}, "top_k"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2147483648}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 2147483648}, "logprobs"),
    ("/v1/chat/completions", {"temperature": 1e39}, "temperature"),
    ("/v1/chat/completions", {"max_tokens": 8.5}, "max_tokens"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": {"a": 1}}]},
     "tool_calls"),
    ("/v1/chat/completions", {"guided_regex": "(" * 2000 + "a" + ")" * 2000}, "structured_output"),
    ("/v1/chat/completions", {"guided_regex": "a{1000000}"}, "output format"),
])  # fmt: skip
def test_bad_numbers_and_formats_are_400s_naming_the_field(stack: dict[str, Any], path: str, extra: dict[str, Any],
                                                            field: str) -> None:  # fmt: skip
    body: dict[str, Any] = {"model": stack["model"], "max_tokens": 4}
    body |= {"prompt": "1 + 1"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "1 + 1"}]}
    body |= extra
    resp = _post(stack, path, body)
    assert resp.status_code == 400, resp.text[:500]
    message = resp.json()["error"]["message"]
    assert field in message and len(message) < 1200  # an echoed pattern is cut short


def test_unusual_valid_requests_are_served(stack: dict[str, Any]) -> None:
    client, model = stack["client"], stack["model"]
    for role in ("developer", "system"):
        reply = client.chat.completions.create(model=model, max_tokens=4, messages=[
            {"role": role, "content": "Answer briefly."}, {"role": "user", "content": "1 + 1"}])  # fmt: skip
        assert reply.choices[0].message.refusal is None
    body = {"model": model, "messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
        {"role": "function", "name": "add", "content": "2"}],
        "max_tokens": 8.0, "top_p": 0, "skip_special_tokens": False}  # fmt: skip
    resp = _post(stack, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["choices"][0]["message"]["refusal"] is None
    greedy = [_post(stack, "/v1/completions", {"model": model, "prompt": "1 + 2 =", "max_tokens": 6, "top_p": 0})
              for _ in range(2)]  # fmt: skip
    assert greedy[0].json()["choices"][0]["text"] == greedy[1].json()["choices"][0]["text"]  # top_p 0: greedy
    # ignore_eos and min_tokens: exactly max_tokens tokens, whatever the model would have ended with
    for extra in ({"ignore_eos": True}, {"min_tokens": 12}):
        resp = _post(stack, "/v1/completions", {"model": model, "prompt": "1 + 2 =", "max_tokens": 12, **extra})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 12, resp.text[:300]


def test_unknown_routes_and_methods_get_json_errors(stack: dict[str, Any]) -> None:
    client = stack["client"]
    with pytest.raises(openai.NotFoundError) as err:
        client.get("/nope", cast_to=httpx2.Response)
    assert "no such endpoint" in err.value.message
    resp = httpx2.get(stack["base"] + "/chat/completions")
    assert resp.status_code == 405 and "not allowed" in resp.json()["error"]["message"]
    assert "POST" in resp.headers["Allow"]


async def _running(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        stats = await worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=5)
        return int(stats.num_running + stats.num_waiting)


def _idle_within(target: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if asyncio.run(_running(target)) == 0:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_request_and_logs_one_line(stack: dict[str, Any], stream: bool) -> None:
    body = {"model": stack["model"], "prompt": "1 + 2 =", "max_tokens": 900, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx2.Client(timeout=60) as http, http.stream("POST", stack["base"] + "/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # leave mid-stream
    else:
        # a whole answer sends nothing before it is done (an HTTP client would wait for the headers until then):
        # the request by hand on a socket, closed once the worker runs it, without reading anything
        url = urllib.parse.urlsplit(stack["base"])
        payload = json.dumps(body).encode()
        head = (f"POST {url.path}/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n")  # fmt: skip
        with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
            conn.sendall(head.encode() + payload)
            deadline = time.monotonic() + 30
            while asyncio.run(_running(stack["worker"])) == 0:
                assert time.monotonic() < deadline, "the worker never ran the request"
                time.sleep(0.02)
    assert _idle_within(stack["worker"], 5), "the worker kept generating for a client that left"
    log = (stack["logs"] / "router.log").read_text()
    assert "Traceback" not in log and "Failed to detach context" not in log


def test_a_queued_request_whose_client_left_leaves_the_queue(tmp_path: Path) -> None:
    """No worker can take it (the only one is unhealthy): the request waits in the queue; its client gives up; it
    is gone from the queue at once, not at its deadline."""
    stats = tmp_path / "stats.json"
    stats.write_text("{}")
    worker, target = start_scripted_worker(stats)
    router, _, base = start_router([target], "--no-worker-timeout", "120", "--queue-timeout", "600")
    health = base.removesuffix("/v1") + "/health"
    stats.write_text(json.dumps({"_unhealthy": True}))
    time.sleep(1.0)  # a few polls: out of rotation

    def queued() -> int:
        resp = httpx2.get(health, timeout=5)
        return sum(resp.json()["queued"].values())

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = {"model": "glm5-scripted", "prompt": "hi"}
            gave_up = pool.submit(httpx2.post, base + "/completions", json=body, timeout=2.5)
            deadline = time.monotonic() + 2
            while not queued() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert queued() == 1  # waiting for a worker
            with pytest.raises(httpx2.TimeoutException):
                gave_up.result()
        deadline = time.monotonic() + 5
        while queued() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queued() == 0
    finally:
        stop(router)
        stop(worker)
