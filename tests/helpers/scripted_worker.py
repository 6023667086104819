"""A worker that speaks the real glm5.v1.Worker gRPC API but streams scripted text instead of running a model.

It isolates the router (tests of reasoning/tool-call parsing and failure handling need outputs a random-weight
model cannot produce; the router benchmark needs a worker that costs nothing). It uses the real tiny model's
tokenizer, so token ids and the tokenizer fingerprint are genuine. The prompt picks the script:

- contains THINK  -> "<think>I add 2 and 3.</think>The answer is 5."
- contains TOOL   -> a get_weather tool call (BADTOOL: a call to an unknown tool)
- contains LONECLOSE -> reasoning closed by a `</think>` that was never opened, then an answer
- contains STRAY  -> tool-call markup with no `<tool_call>` (a model that lost the format)
- contains FAIL_BEFORE -> UNAVAILABLE before any token;  FAIL_AFTER -> two chunks, then UNAVAILABLE
- contains SLOW   -> 50 ms between chunks;  PAUSE -> 6 s between the first chunk and the second
(`stream_interval` is honoured: chunks are held back until that many tokens are ready, the last one carries the rest)
- otherwise       -> `max_new_tokens` chunks of " token" (one token each)

With --step-ms S the chunks follow an engine's clock instead of coming all at once: every S milliseconds each
running request gets its next chunk, all in the same instant (what a worker's decode step does).

GetStats reports the numbers in the JSON file given with --stats-file (re-read on every call), so a test can
make the worker look fragmented or jittery; in that file `"_unhealthy": true` makes GetStats fail and
`"_fail": "before"` makes every Generate fail before its first token; `"_no_tokenizer": true` makes
GetTokenizer fail (UNAVAILABLE).

    python -m tests.helpers.scripted_worker --port 50999 [--stats-file f.json] [--step-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from glm5.model.presets import default_model_path
from glm5.serving import RequestFailed, merge_response, serve_multiplexed
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

SCRIPTS = {
    "THINK": ["<think>", "I add 2 ", "and 3.", "</th", "ink>", "The answer ", "is 5."],
    "BADTOOL": ["Let me send it.",
                "<tool_call>send_email<arg_key>to</arg_key><arg_value>x@y.z</arg_value></tool_call>"],
    "LONECLOSE": [" + 30 + 30 = 5", "2</thi", "nk>The answer ", "is 52."],
    "STRAY": ["The answer is * 5", "1151</arg_value><arg_key>b</arg_key>", "<arg_value>2</arg_value></tool_call>"],
    "TOOL": ["<think>Need the weather.</think>", "Checking.", "<tool_call>get_weather<arg_key>city</arg_key>",
             "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"],
}  # fmt: skip
PAUSE_S = 6.0  # longer than redis-py's 5 s socket timeout: what once turned a slow token into a 500


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):  # type: ignore[misc]
    def __init__(self, tokenizer: Tokenizer, stats_file: Path | None, name: str, step_ms: float = 0.0) -> None:
        self.tok = tokenizer
        self.stats_file = stats_file
        self.name = name
        self.served = 0
        self.running = 0
        self.step_s = step_ms / 1000
        self._step: asyncio.Future[None] | None = None  # resolved at the next engine step (--step-ms)

    async def _next_step(self) -> None:
        if self._step is None:
            self._step = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(self.step_s, self._tick)
        await asyncio.shield(self._step)

    def _tick(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.set_result(None)

    def _control(self) -> dict[str, Any]:
        if self.stats_file is not None and self.stats_file.exists():
            return dict(json.loads(self.stats_file.read_text() or "{}"))
        return {}

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for resp in self._generate(request):
                yield resp
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)

    async def GenerateStream(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.send_initial_metadata(())  # the caller waits for it before writing (router: WorkerStream)
        async for resp in serve_multiplexed(self._generate, request_iterator):
            yield resp

    async def _generate(self, request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        self.served += 1
        self.running += 1
        try:
            prompt = request.prompt or self.tok.decode(list(request.prompt_token_ids))
            n = request.sampling.max_new_tokens if request.sampling.HasField("max_new_tokens") else 16
            if "FAIL_BEFORE" in prompt or self._control().get("_fail") == "before":
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "scripted failure before the first token")
            script = next((v for k, v in SCRIPTS.items() if k in prompt), [" token"] * n)
            tail = prompt.rstrip()
            if "THINK" in prompt and tail.endswith("</think>") and not tail.endswith("<think></think>"):
                script = ["The answer ", "is 5."]  # a continuation after forced </think>: answer only
            delay = 0.05 if "SLOW" in prompt else 0.0
            pause = PAUSE_S if "PAUSE" in prompt else 0.0
            total = 0
            held: worker_pb2.GenerateResponse | None = None  # stream_interval: tokens held back so far
            for i, text in enumerate(script):
                if self.step_s:
                    await self._next_step()
                if "FAIL_AFTER" in prompt and i == 2:
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "scripted failure mid-stream")
                ids = self.tok.encode(text)
                total += len(ids)
                last = i == len(script) - 1
                resp = worker_pb2.GenerateResponse(
                    request_id=request.request_id, token_ids=ids, text=text,
                    finish_reason=common_pb2.FINISH_REASON_STOP if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                    usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=total),
                )  # fmt: skip
                if held is not None:
                    merge_response(held, resp)
                    resp = held
                if len(resp.token_ids) < request.stream_interval and not last:
                    held = resp
                else:
                    held = None
                    yield resp
                if delay:
                    await asyncio.sleep(delay)
                if pause and i == 0:
                    await asyncio.sleep(pause)
        finally:
            self.running -= 1

    async def GetStats(self, request: worker_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> Any:
        values = self._control()
        if values.pop("_unhealthy", False):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: unhealthy")
        values.pop("_fail", None)
        values.pop("_no_tokenizer", None)
        return worker_pb2.WorkerStats(num_running=self.running, generated_tokens_total=self.served, **values)

    async def GetModelInfo(self, request: worker_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> Any:
        return worker_pb2.ModelInfo(
            served_model_name=self.name, architecture="GlmMoeDsaForCausalLM", max_model_len=8192,
            vocab_size=self.tok.vocab_size, eos_token_ids=self.tok.eos_token_ids(), dtype="float32", device="cpu",
            tokenizer_fingerprint=self.tok.fingerprint,
        )  # fmt: skip

    async def GetTokenizer(self, request: worker_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext) -> Any:
        if self._control().get("_no_tokenizer"):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: no tokenizer")
        tokenizer_json, config = self.tok.files
        # a scripted model follows the template's thinking switch (it is not the demo model, which reasons always)
        settings = json.loads(config)
        settings.pop("glm5_thinking_off", None)
        return worker_pb2.TokenizerFiles(
            tokenizer_json=tokenizer_json, tokenizer_config_json=json.dumps(settings), fingerprint=self.tok.fingerprint
        )


async def serve(port: int, stats_file: Path | None, name: str, step_ms: float) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(
        ScriptedWorker(Tokenizer(default_model_path()), stats_file, name, step_ms), server
    )  # type: ignore[no-untyped-call]
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stats-file", type=Path)
    parser.add_argument("--name", default="glm5-scripted")
    parser.add_argument("--step-ms", type=float, default=0.0)
    a = parser.parse_args()
    asyncio.run(serve(a.port, a.stats_file, a.name, a.step_ms))
