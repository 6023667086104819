"""`glm5 serve`, the README's first command: workers + router on this machine, an OpenAI client talks to it,
Ctrl-C stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.helpers.procs import free_port, wait_http


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _workers_answer_only_the_router(workers: list[int], log: Path) -> None:
    """Every run has its own internal token, in the workers' environment: not on their command lines, not in the
    log; a call without it is refused, health checks stay open."""
    import grpc
    from glm5.security import INTERNAL_TOKEN_METADATA
    from glm5.v1 import worker_pb2, worker_pb2_grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tokens = set()
    for pid in workers:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
        name = argv[argv.index(b"--internal-token-env") + 1]
        token = environ[name].decode()
        tokens.add(token)
        assert len(token) >= 32 and not any(token.encode() in a for a in argv)
        assert token not in log.read_text()
        with grpc.insecure_channel(f"127.0.0.1:{argv[argv.index(b'--port') + 1].decode()}") as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=10,
                                     metadata=((INTERNAL_TOKEN_METADATA, token),)).served_model_name  # fmt: skip
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert len(tokens) == 1  # one per run, shared by its workers


def test_glm5_serve_runs_the_stack_and_stops_cleanly(tmp_path: Path) -> None:
    http_port, grpc_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "glm5_cli", "serve", "--workers", "2", "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), "--worker-arg=--kv-cache-bytes=64MiB",
           "--worker-arg=--max-model-len=2048"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        wait_http(f"http://127.0.0.1:{http_port}/health", proc, timeout=300)
        children = _children(proc.pid)
        assert len(children) == 2  # the two workers
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=2)
        (model,) = client.models.list().data
        reply = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "2 + 3?"}],
                                               max_tokens=8)  # fmt: skip
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        assert "OpenAI HTTP: http://localhost:" in log.read_text()
        _workers_answer_only_the_router(children, log)
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]
    assert not any(_alive(c) for c in children), "workers left behind"


def test_serve_restarts_a_killed_worker_and_stops_within_the_grace(tmp_path: Path) -> None:
    """A SIGKILLed worker under load: requests on it fail or move on, serve starts it again, and requests after
    the restart succeed; SIGTERM then stops everything within the drain grace plus 5 s."""
    import concurrent.futures
    import time

    http_port, grpc_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "glm5_cli", "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
           "--worker-arg=--kv-cache-bytes=64MiB", "--worker-arg=--max-model-len=2048", "--shutdown-grace", "3",
           "--no-worker-timeout", "60"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        wait_http(f"http://127.0.0.1:{http_port}/health", proc, timeout=300)
        (worker,) = _children(proc.pid)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0,
                               timeout=120)  # fmt: skip
        model = client.models.list().data[0].id

        def ask(i: int) -> str:
            try:
                r = client.completions.create(model=model, prompt=f"{i} + 1 =", max_tokens=200,
                                              extra_body={"ignore_eos": True})  # fmt: skip
                return r.choices[0].finish_reason or ""
            except openai.APIError as exc:
                return type(exc).__name__

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            during = [pool.submit(ask, i) for i in range(4)]
            time.sleep(1.0)
            os.kill(worker, signal.SIGKILL)  # under load
            outcomes = [f.result(timeout=120) for f in during]
        assert all(outcomes), outcomes  # each ended one way or the other; none hung
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            kids = _children(proc.pid)
            if kids and kids != [worker]:
                break
            time.sleep(0.2)
        assert kids and worker not in kids, "the worker was not restarted"
        after = [ask(i) for i in range(3)]  # the router takes the restarted worker back
        assert after == ["length"] * 3, after
        text = log.read_text()
        assert "exited with status -9; restarting" in text and "restarting the worker" in text
    finally:
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        took = time.monotonic() - start
    assert code == 0, log.read_text()[-3000:]
    assert took < 3 + 5, f"SIGTERM took {took:.1f}s"


def test_serve_api_keys_and_router_args_reach_the_router(tmp_path: Path) -> None:
    """`glm5 serve --api-key-env` (as `vllm serve --api-key`): requests without the key are 401, with it served;
    --router-arg passes any `glm5 router` flag on; the banner's hint names the real URL and the key it needs."""
    http_port, grpc_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "glm5_cli", "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
           "--api-key-env", "SERVE_TEST_KEYS", "--router-arg=--max-queued=7", "--worker-arg=--kv-cache-bytes=64MiB",
           "--worker-arg=--max-model-len=2048"]  # fmt: skip
    env = {**os.environ, "SERVE_TEST_KEYS": "serve-key-1,serve-key-2"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_http(f"http://127.0.0.1:{http_port}/health", proc, timeout=300)
        base = f"http://127.0.0.1:{http_port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=base, api_key="serve-key-2", max_retries=2)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "2 + 3?"}],
                                               max_tokens=4)  # fmt: skip
        assert reply.choices[0].finish_reason in ("stop", "length")
        text = log.read_text()
        assert "(API keys required)" in text and f"GLM5_URL=http://localhost:{http_port}/v1" in text
        assert "GLM5_API_KEY=<key>" in text and "serve-key" not in text
        chat = [sys.executable, "-m", "glm5_cli", "chat", "--max-tokens", "4", "What is 12 + 30?"]
        env = {**os.environ, "GLM5_URL": base}
        env.pop("OPENAI_API_KEY", None)
        refused = subprocess.run(chat, capture_output=True, text=True, timeout=60, env=env)
        assert refused.returncode == 1 and "wants an API key: set GLM5_API_KEY" in refused.stderr
        served = subprocess.run(
            chat, capture_output=True, text=True, timeout=120, env={**env, "GLM5_API_KEY": "serve-key-1"}
        )
        assert served.returncode == 0 and served.stdout.strip(), served.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]


def test_serve_refuses_a_bad_router_arg_before_starting_anything() -> None:
    done = subprocess.run([sys.executable, "-m", "glm5_cli", "serve", "--http-port", str(free_port()),
                           "--grpc-port", str(free_port()), "--router-arg=--no-such-flag"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and "--router-arg" in done.stderr and "--no-such-flag" in done.stderr
