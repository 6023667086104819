"""Reading the internal token (glm5.security) and the stub that sends it (glm5.client.worker_stub)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from glm5.client import WORKER_METHODS, worker_stub
from glm5.errors import ConfigError
from glm5.security import INTERNAL_TOKEN_METADATA, Secret, internal_token_from_args
from glm5.v1 import worker_pb2, worker_pb2_grpc
from glm5_cli.main import parse_args


def _token(*flags: str) -> Secret | None:
    return internal_token_from_args(parse_args(["worker", *flags]))


def test_the_token_comes_from_a_file_or_a_variable_and_an_empty_one_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _token() is None  # no flag: no token (local development)
    file = tmp_path / "token"
    file.write_text("s3cret\n")
    token = _token("--internal-token-file", str(file))
    assert token is not None and token.value == "s3cret" and "s3cret" not in repr(token)
    monkeypatch.setenv("GLM5_T", "from-env")
    assert (_token("--internal-token-env", "GLM5_T") or Secret("")).value == "from-env"
    file.write_text("\n  \n")  # a Secret mounted empty must not leave the worker open to anyone
    with pytest.raises(ConfigError, match="holds no token"):
        _token("--internal-token-file", str(file))
    monkeypatch.setenv("GLM5_T", "")
    with pytest.raises(ConfigError, match="holds no token"):
        _token("--internal-token-env", "GLM5_T")
    with pytest.raises(ConfigError, match="cannot read"):
        _token("--internal-token-file", str(tmp_path / "missing"))


class _Echo(worker_pb2_grpc.WorkerServicer):  # type: ignore[misc]
    """Answers GetModelInfo and Generate with the metadata keys the call carried, in order."""

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> worker_pb2.ModelInfo:
        return worker_pb2.ModelInfo(served_model_name=",".join(_keys(context)))

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        yield worker_pb2.GenerateResponse(text=",".join(_keys(context)))


def _keys(context: grpc.aio.ServicerContext) -> list[str]:
    return [f"{k}={v}" for k, v in context.invocation_metadata() if k.startswith("x-")]


def test_worker_stub_sends_the_token_on_every_method_ahead_of_the_callers_metadata() -> None:
    assert {"Generate", "GenerateStream", "UpdateWeights", "PushWeights", "GetStats"} <= set(WORKER_METHODS)

    async def go() -> tuple[str, str, str]:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(_Echo(), server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = worker_stub(ch, Secret("t0k"))
                info = await stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), metadata=(("x-admin", "a"),))
                streamed = [r.text async for r in stub.Generate(worker_pb2.GenerateRequest())]
                plain = await worker_stub(ch, None).GetModelInfo(worker_pb2.GetModelInfoRequest())
                return info.served_model_name, streamed[0], plain.served_model_name
        finally:
            await server.stop(None)

    with_admin, streamed, plain = asyncio.run(go())
    assert with_admin == f"{INTERNAL_TOKEN_METADATA}=t0k,x-admin=a"
    assert streamed == f"{INTERNAL_TOKEN_METADATA}=t0k"
    assert plain == ""  # no token: the stub is grpc's own
