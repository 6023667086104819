"""Probes an attacker sends, against a real router (with and without a Redis queue) over scripted workers: every
malformed input is a 4xx contained to its own request, and the request after it is served; credentials never reach
a log line; slow and idle connections are closed and open connections are capped; without a key, /health and
/metrics do not publish the workers."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.helpers.procs import start_redis, start_router, start_scripted_worker, stop

KEY = "red-team-key-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

# (name, path, raw body, extra raw header lines): every class of malformed input we know of
BAD_BODIES: list[tuple[str, str, bytes]] = [
    ("lone surrogate in user", "/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"user":"\\ud800"}'),
    ("lone low surrogate in content", "/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"a\\udc00b"}],"max_tokens":3}'),
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt":"x\\ud83d","max_tokens":3}'),
    ("lone surrogate in stop", "/v1/completions", b'{"prompt":"x","stop":["\\udfff"],"max_tokens":3}'),
    ("lone surrogate in tokenize", "/tokenize", b'{"prompt":"\\ud800"}'),
    ("lone surrogate in a tool", "/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":'
     b'{"name":"f","description":"\\ud800"}}]}'),
    ("invalid UTF-8 bytes", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"\xff\xfe"}]}'),
    ("deep array nesting", "/v1/chat/completions", b"[" * 100_000),
    ("deep object nesting", "/v1/completions", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    ("NaN literal", "/v1/completions", b'{"prompt":"x","temperature":NaN}'),
    ("Infinity literal", "/v1/completions", b'{"prompt":"x","top_p":-Infinity}'),
    ("not an object", "/v1/completions", b'["prompt"]'),
    ("truncated JSON", "/v1/completions", b'{"prompt":"x'),
    ("overlong user", "/v1/chat/completions", json.dumps({**CHAT, "user": "u" * 5000}).encode()),
    ("user with a newline", "/v1/chat/completions", json.dumps({**CHAT, "user": "a\nb"}).encode()),
]  # fmt: skip
BAD_HEADERS: list[tuple[str, bytes]] = [
    ("non-UTF-8 session id", b"X-Session-Id: \xff\xfe"),
    ("non-UTF-8 request id", b"X-Request-Id: \xc3\x28"),
    ("overlong request id", b"X-Request-Id: " + b"r" * 4000),
    ("request id with a tab", b"X-Request-Id: a\tb"),
]


@pytest.fixture(scope="module", params=["in-process", "redis"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp(f"red-team-{request.param}")
    redis = None
    extra: list[str] = ["--api-key", KEY, "--http-idle-timeout", "1.5", "--http-body-timeout", "1.5",
                        "--http-max-connections", "16"]  # fmt: skip
    if request.param == "redis":
        redis, url = start_redis(tmp)
        extra += ["--redis-url", url]
    worker, target = start_scripted_worker()
    router, grpc_target, base = start_router([target], *extra, log=tmp / "router.log")
    try:
        yield {"base": base.removesuffix("/v1"), "log": tmp / "router.log", "worker": target, "grpc": grpc_target,
               "port": int(base.rsplit(":", 1)[1].split("/")[0])}  # fmt: skip
    finally:
        stop(router)
        stop(worker)
        if redis is not None:
            stop(redis)


def _raw(port: int, head: bytes, body: bytes = b"", timeout: float = 10.0) -> tuple[int, bytes]:
    """One HTTP/1.1 request written byte for byte (no client library would send these): (status, response)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + b"\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def _request(path: str, body: bytes, *headers: bytes, auth: bytes = f"Authorization: Bearer {KEY}".encode()) -> bytes:
    lines = [f"POST {path} HTTP/1.1".encode(), b"Host: router", b"Content-Type: application/json",
             f"Content-Length: {len(body)}".encode(), b"Connection: close", auth, *headers]  # fmt: skip
    return b"".join(line + b"\r\n" for line in lines)


def _good(stack: dict[str, Any]) -> None:
    resp = httpx2.post(stack["base"] + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=30)
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["choices"][0]["message"]["content"] == " token" * 3


@pytest.mark.parametrize("name,path,body", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_a_malformed_body_is_a_4xx_and_the_next_request_is_served(stack: dict[str, Any], name: str, path: str,
                                                                  body: bytes) -> None:  # fmt: skip
    status, resp = _raw(stack["port"], _request(path, body), body)
    assert 400 <= status < 500, (name, resp[:400])
    assert b'"error"' in resp
    _good(stack)


@pytest.mark.parametrize("name,header", BAD_HEADERS, ids=[h[0] for h in BAD_HEADERS])
def test_a_malformed_header_is_a_4xx_and_the_next_request_is_served(stack: dict[str, Any], name: str,
                                                                    header: bytes) -> None:  # fmt: skip
    body = json.dumps(CHAT).encode()
    status, resp = _raw(stack["port"], _request("/v1/chat/completions", body, header), body)
    assert status == 400, (name, resp[:400])
    _good(stack)


def test_malformed_credentials_are_401_or_400_and_never_logged(stack: dict[str, Any]) -> None:
    body = json.dumps(CHAT).encode()
    for auth, expected in [(b"Authorization: Bearer \xff\xfe", 401), (b"Authorization: \xff", 401),
                           (b"Authorization: Bearer " + KEY.encode() + b"\x00", 400),
                           (b"Authorization: Bearer " + KEY.encode() + b"\x01x", 400),
                           (b"Authorization: Bearer " + KEY.encode() + b"\xff", 401)]:  # fmt: skip
        status, resp = _raw(stack["port"], _request("/v1/chat/completions", body, auth=auth), body)
        assert status == expected, (auth, resp[:300])
        _good(stack)
    time.sleep(0.2)  # the router's log is written by its own process
    log = stack["log"].read_text()
    assert KEY not in log, "an API key reached the router's log"
    assert "Traceback" not in log


def test_an_oversized_content_length_is_refused_from_the_header_alone(stack: dict[str, Any]) -> None:
    start = time.monotonic()
    head = _request("/v1/chat/completions", b"").replace(b"Content-Length: 0", b"Content-Length: 9437184")
    with socket.create_connection(("127.0.0.1", stack["port"]), timeout=10) as s:
        s.sendall(head + b"\r\n")  # and no body at all
        data = s.recv(65536)
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert time.monotonic() - start < 2.0
    _good(stack)


def test_slow_and_idle_connections_are_closed(stack: dict[str, Any]) -> None:
    """--http-idle-timeout 1.5: an idle connection and one trickling its header are closed; --http-body-timeout
    1.5: a body that does not arrive is a 408."""

    def closed_within(s: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
        deadline = time.monotonic() + seconds
        try:
            for byte in trickle:
                s.sendall(bytes([byte]))
                time.sleep(0.25)
                if time.monotonic() > deadline:
                    return False
            s.settimeout(max(0.1, deadline - time.monotonic()))
            while s.recv(65536):
                pass
            return True  # end of stream: the router closed it
        except (BrokenPipeError, ConnectionResetError):
            return True
        except TimeoutError:
            return False

    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", stack["port"])) as idle:
        assert closed_within(idle, 6.0)
    with socket.create_connection(("127.0.0.1", stack["port"])) as slowloris:
        assert closed_within(slowloris, 6.0, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 40)
    assert time.monotonic() - start < 10
    head = _request("/v1/completions", b"").replace(b"Content-Length: 0", b"Content-Length: 100")
    with socket.create_connection(("127.0.0.1", stack["port"]), timeout=10) as slow_body:
        slow_body.sendall(head + b"\r\n" + b'{"prompt":')
        data = slow_body.recv(65536)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    _good(stack)


def test_open_connections_are_capped(stack: dict[str, Any]) -> None:
    held = [socket.create_connection(("127.0.0.1", stack["port"])) for _ in range(16)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", stack["port"]), timeout=5) as extra:
            data = extra.recv(65536)
        assert data.startswith(b"HTTP/1.1 503"), data[:200]
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # the router sees the held connections close
        try:
            _good(stack)
            break
        except (AssertionError, httpx2.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_without_a_key_health_and_metrics_do_not_name_the_workers(stack: dict[str, Any]) -> None:
    open_health = httpx2.get(stack["base"] + "/health", timeout=10)
    assert open_health.status_code == 200 and open_health.json()["status"] == "ok"
    assert stack["worker"] not in open_health.text and "workers" not in open_health.json()
    assert open_health.json()["dispatcher"]["failing"] is False
    keyed = httpx2.get(stack["base"] + "/health", headers=AUTH, timeout=10)
    assert keyed.json()["workers"][0]["address"] == stack["worker"]
    assert httpx2.get(stack["base"] + "/metrics", timeout=10).status_code == 401
    metrics = httpx2.get(stack["base"] + "/metrics", headers=AUTH, timeout=10)
    assert metrics.status_code == 200 and "glm5_router_dispatch_failures_total" in metrics.text


def test_public_metrics_opens_metrics_only(tmp_path: Path) -> None:
    worker, target = start_scripted_worker()
    router, _, base = start_router([target], "--api-key", KEY, "--public-metrics")
    try:
        root = base.removesuffix("/v1")
        assert httpx2.get(root + "/metrics", timeout=10).status_code == 200
        assert "workers" not in httpx2.get(root + "/health", timeout=10).json()
        assert httpx2.post(root + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 401
    finally:
        stop(router)
        stop(worker)
