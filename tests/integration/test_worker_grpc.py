"""`glm5 worker` as a real process on a localhost port, exercised with real gRPC clients."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from glm5.client import sampling
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.helpers.procs import start_worker, stop

WORKER_ARGS = ("--kv-cache-bytes", "48MiB", "--max-model-len", "2048", "--block-size", "16")


@pytest.fixture(scope="module")
def worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    proc, target = start_worker(tiny_model, *WORKER_ARGS, log=log)
    yield target
    assert stop(proc) == 0, log.read_text()[-3000:]


@pytest.fixture
def stub(worker: str):
    with grpc.insecure_channel(worker) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def generate(stub, **kw) -> list[worker_pb2.GenerateResponse]:
    return list(stub.Generate(worker_pb2.GenerateRequest(**kw), timeout=60))


def test_streams_tokens_with_usage_and_logprobs(stub) -> None:
    resps = generate(
        stub,
        prompt="What is 12 + 30?",
        sampling=sampling(temperature=0.0, max_new_tokens=12, ignore_eos=True),
        return_logprobs=True,
    )
    assert len(resps) >= 2, "tokens must stream, not arrive in one message"
    tokens = [t for r in resps for t in r.token_ids]
    assert len(tokens) == 12
    assert len([lp for r in resps for lp in r.logprobs]) == 12
    assert all(lp.logprob <= 0 for r in resps for lp in r.logprobs)
    last = resps[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 12 and last.usage.prompt_tokens > 0
    text = "".join(r.text for r in resps)
    detok = stub.Detokenize(worker_pb2.DetokenizeRequest(token_ids=tokens))
    assert text == detok.text


def test_greedy_is_deterministic_and_seeded_sampling_repeats(stub) -> None:
    def run(**s) -> list[int]:
        return [
            t for r in generate(stub, prompt="hello", sampling=sampling(max_new_tokens=8, **s)) for t in r.token_ids
        ]

    assert run(temperature=0.0) == run(temperature=0.0)
    assert run(temperature=1.0, seed=5) == run(temperature=1.0, seed=5)


def test_stream_interval_coalesces_tokens_without_changing_them(stub) -> None:
    kw = dict(prompt="What is 12 + 30?", return_logprobs=True,
              sampling=sampling(temperature=1.0, seed=3, max_new_tokens=11, ignore_eos=True))  # fmt: skip
    each = generate(stub, **kw)
    every4 = generate(stub, stream_interval=4, **kw)
    whole = generate(stub, stream_interval=11, **kw)
    assert all(len(r.token_ids) >= 4 for r in every4[:-1])
    assert len(every4) <= 3 < len(each)
    assert len(whole) == 1 and whole[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    for resps in (every4, whole):
        assert [t for r in resps for t in r.token_ids] == [t for r in each for t in r.token_ids]
        assert [lp.logprob for r in resps for lp in r.logprobs] == [lp.logprob for r in each for lp in r.logprobs]
        assert "".join(r.text for r in resps) == "".join(r.text for r in each)
        assert resps[-1].usage.completion_tokens == 11


def test_reflection_lists_the_services(worker: str) -> None:
    with grpc.insecure_channel(worker) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert {"glm5.v1.Worker", "grpc.health.v1.Health"} <= names
        req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="glm5.v1.Worker")
        reply = next(stub.ServerReflectionInfo(iter([req])))
        assert reply.file_descriptor_response.file_descriptor_proto


def test_health_serving(worker: str) -> None:
    with grpc.insecure_channel(worker) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "glm5.v1.Worker"):
            status = stub.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    ("request_kw", "field"),
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt_token_ids=[1, 10**6]), "prompt_token_ids"),
        (dict(prompt="x" * 3000), "prompt"),
        (dict(prompt="hi", sampling=sampling(max_new_tokens=0)), "max_new_tokens"),
        (dict(prompt="hi", sampling=sampling(max_new_tokens=5000)), "max_new_tokens"),
        (dict(prompt="hi", sampling=sampling(temperature=-1.0)), "temperature"),
        (dict(prompt="hi", sampling=sampling(top_p=0.0)), "top_p"),
        (dict(prompt="hi", sampling=sampling(top_p=1.01)), "top_p"),
        (dict(prompt="hi", sampling=sampling(presence_penalty=3.0)), "presence_penalty"),
        (dict(prompt="hi", sampling=sampling(frequency_penalty=-2.5)), "frequency_penalty"),
        (dict(prompt="hi", sampling=sampling(logit_bias={10**6: 1.0})), "logit_bias"),
        (dict(prompt="hi", sampling=sampling(logit_bias={5: -150.0})), "logit_bias"),
        # a structured_output with no format in it (a sub-message set by touching one of its other fields)
        (
            dict(prompt="hi", sampling=sampling(structured_output=common_pb2.StructuredOutput(starts_thinking=True))),
            "structured_output",
        ),
        (dict(prompt="hi", sampling=sampling(structured_output=common_pb2.StructuredOutput(regex="[x"))), "regex"),
        (dict(prompt="hi", prompt_token_ids=[1, 2]), "prompt"),
        (dict(prompt="hi", top_logprobs=50), "top_logprobs"),
        (dict(prompt="hi", stream_interval=-1), "stream_interval"),
    ],
)
def test_bad_input_is_invalid_argument(stub, request_kw: dict, field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, **request_kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    # and the server keeps serving
    assert generate(stub, prompt="ok", sampling=sampling(max_new_tokens=2))[-1].finish_reason


def test_tokenize_roundtrip_and_bad_ids(stub) -> None:
    ids = stub.Tokenize(worker_pb2.TokenizeRequest(text="What is 1 + 2?")).token_ids
    assert stub.Detokenize(worker_pb2.DetokenizeRequest(token_ids=ids)).text == "What is 1 + 2?"
    with pytest.raises(grpc.RpcError) as err:
        stub.Detokenize(worker_pb2.DetokenizeRequest(token_ids=[-1]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_info_and_stats(stub) -> None:
    info = stub.GetModelInfo(worker_pb2.GetModelInfoRequest())
    assert info.architecture == "GlmMoeDsaForCausalLM" and info.max_model_len == 2048
    assert len(info.tokenizer_fingerprint) == 64 and info.eos_token_ids
    files = stub.GetTokenizer(worker_pb2.GetTokenizerRequest())
    assert files.fingerprint == info.tokenizer_fingerprint
    remote = Tokenizer.from_files(files.tokenizer_json, files.tokenizer_config_json)
    assert remote.fingerprint == info.tokenizer_fingerprint  # the router's copy is the worker's tokenizer
    assert remote.encode("What is 1 + 2?") == list(
        stub.Tokenize(worker_pb2.TokenizeRequest(text="What is 1 + 2?")).token_ids
    )
    generate(stub, prompt="a b c d e f g", sampling=sampling(max_new_tokens=20, ignore_eos=True))
    stats = stub.GetStats(worker_pb2.GetStatsRequest())
    assert stats.kv_blocks_total > 0 and stats.kv_block_size == 16
    assert 0 <= stats.kv_usage <= 1 and 0 <= stats.kv_fragmentation <= 1
    assert stats.generated_tokens_total >= 20 and stats.mean_token_latency_ms > 0
    assert len(stats.layers) == 4


def test_a_speculating_worker_answers_as_one_that_does_not_and_reports_its_drafts(
    tiny_model: Path, tmp_path: Path, stub
) -> None:
    """`glm5 worker --speculative-config` (vLLM's flag): prompt-lookup drafts on a prompt that repeats itself, the
    same greedy tokens and log-probs as the worker without it, and GetStats' speculative counters (the router
    exports them as glm5_worker_spec_decode_*)."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    log = tmp_path / "worker.log"
    proc, target = start_worker(tiny_model, *WORKER_ARGS, "--speculative-config", spec, log=log)
    ids = [(7 * i) % 13 + 40 for i in range(13)] * 4  # a repeating prompt: its n-grams have continuations
    request = dict(prompt_token_ids=ids, sampling=sampling(temperature=0.0, max_new_tokens=24, ignore_eos=True),
                   return_logprobs=True)  # fmt: skip
    try:
        with grpc.insecure_channel(target) as channel:
            drafting = worker_pb2_grpc.WorkerStub(channel)
            got = generate(drafting, **request)
            stats = drafting.GetStats(worker_pb2.GetStatsRequest())
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    want = generate(stub, **request)
    assert [t for r in got for t in r.token_ids] == [t for r in want for t in r.token_ids]
    lp_got, lp_want = ([lp.logprob for r in rs for lp in r.logprobs] for rs in (got, want))
    assert lp_got == pytest.approx(lp_want, abs=1e-4)
    s = stats.speculative
    assert stats.HasField("speculative") and (s.method, s.num_speculative_tokens) == ("ngram", 3)
    assert s.drafts_total > 0 and s.draft_tokens_total >= s.drafts_total >= 1
    assert len(s.accepted_tokens_by_position) == 3 and sum(s.accepted_tokens_by_position) == s.accepted_tokens_total
    assert not stub.GetStats(worker_pb2.GetStatsRequest()).HasField("speculative")  # a worker that does not draft


def test_a_full_kv_pool_preempts_and_reports_it(tiny_model: Path, tmp_path: Path) -> None:
    """A pool of ~10 blocks of 16 tokens and three requests of ~120 tokens each: the newest sequences are
    preempted and recomputed, every request still gets all its tokens, and GetStats counts the preemptions
    (the router exports them as glm5_worker_preemptions_total)."""
    log = tmp_path / "worker.log"
    proc, target = start_worker(tiny_model, "--kv-cache-bytes", "256KiB", "--no-kv-int8-tier", "--max-model-len",
                                "128", "--block-size", "16", log=log)  # fmt: skip

    async def go() -> tuple[list[int], worker_pb2.WorkerStats]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)

            async def one(i: int) -> int:
                req = worker_pb2.GenerateRequest(prompt=f"request {i}: a b c d e f g h",
                                                 sampling=sampling(max_new_tokens=100, ignore_eos=True))  # fmt: skip
                return sum([len(r.token_ids) async for r in stub.Generate(req, timeout=120)])

            counts = await asyncio.gather(*(one(i) for i in range(3)))
            return list(counts), await stub.GetStats(worker_pb2.GetStatsRequest())

    try:
        counts, stats = asyncio.run(go())
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    assert counts == [100, 100, 100]
    assert stats.preemptions_total > 0


def test_cancelled_stream_frees_the_request(worker: str) -> None:
    async def go() -> worker_pb2.WorkerStats:
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            call = stub.Generate(
                worker_pb2.GenerateRequest(prompt="count", sampling=sampling(max_new_tokens=1500, ignore_eos=True))
            )
            got = 0
            async for _ in call:
                got += 1
                if got == 3:
                    call.cancel()
                    break
            for _ in range(100):
                stats = await stub.GetStats(worker_pb2.GetStatsRequest())
                if stats.num_running == 0:
                    return stats
                await asyncio.sleep(0.05)
            return stats

    stats = asyncio.run(go())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.generated_tokens_total < 1500


def test_generate_stream_multiplexes_requests(worker: str) -> None:
    """Worker.GenerateStream: requests interleave on one stream, each gets what Generate gives it; a bad request
    fails alone (its error_code) and a duplicate id is refused; cancel frees a request; half-closing the stream
    lets the open requests finish, then it ends."""
    greedy = sampling(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    prompts = ["What is 1 + 2?", "Name a colour."]

    async def go() -> tuple[dict[int, list], worker_pb2.WorkerStats, list[int]]:
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            expected = []
            for p in prompts:
                expected.append([t async for r in stub.Generate(worker_pb2.GenerateRequest(prompt=p, sampling=greedy))
                                 for t in r.token_ids])  # fmt: skip
            call = stub.GenerateStream()
            start, many = worker_pb2.GenerateStreamRequest, worker_pb2.GenerateStreamRequests
            await call.write(many(requests=[  # a message may carry several actions
                start(id=1, start=worker_pb2.GenerateRequest(prompt=prompts[0], sampling=greedy)),
                start(id=2, start=worker_pb2.GenerateRequest(prompt=prompts[1], sampling=greedy))]))  # fmt: skip
            await call.write(
                many(requests=[start(id=3, start=worker_pb2.GenerateRequest(prompt="x", stream_interval=-1))])
            )
            long = worker_pb2.GenerateRequest(prompt="count", sampling=sampling(max_new_tokens=1500, ignore_eos=True))
            await call.write(
                many(requests=[start(id=4, start=long), start(id=4, start=long)])
            )  # a second start under an open id
            got: dict[int, list] = {}
            cancelled = False
            async for batch in call:
                for msg in batch.responses:
                    got.setdefault(msg.id, []).append(msg)
                if not cancelled and any(m.response.token_ids for m in got.get(4, [])):
                    await call.write(many(requests=[start(id=4, cancel=True)]))
                    cancelled = True
                done = [i for i in (1, 2) if got.get(i) and got[i][-1].response.finish_reason]
                if len(done) == 2 and cancelled:
                    await call.done_writing()
            for _ in range(100):
                stats = await stub.GetStats(worker_pb2.GetStatsRequest())
                if stats.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            return got, stats, [t for e in expected for t in e]

    got, stats, expected = asyncio.run(asyncio.wait_for(go(), 120))
    tokens = [t for i in (1, 2) for m in got[i] for t in m.response.token_ids]
    assert tokens == expected, "each request streams what Generate streams for it"
    assert all(m.response.request_id for i in (1, 2) for m in got[i])
    (bad,) = got[3]
    assert bad.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "stream_interval" in bad.error_message
    dup = [m for m in got[4] if m.error_code]
    assert len(dup) == 1 and "already open" in dup[0].error_message
    assert sum(len(m.response.token_ids) for m in got[4]) < 1500, "the cancelled request stopped"
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_concurrent_streams_are_batched(worker: str) -> None:
    async def go() -> list[int]:
        async with grpc.aio.insecure_channel(worker) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)

            async def one(i: int) -> int:
                n = 0
                req = worker_pb2.GenerateRequest(
                    prompt=f"request {i}", sampling=sampling(max_new_tokens=16, ignore_eos=True)
                )
                async for r in stub.Generate(req):
                    n += len(r.token_ids)
                return n

            return await asyncio.gather(*(one(i) for i in range(8)))

    assert asyncio.run(go()) == [16] * 8


def test_graceful_shutdown_drains_running_requests(tiny_model: Path, tmp_path: Path) -> None:
    proc, target = start_worker(tiny_model, *WORKER_ARGS, "--shutdown-grace", "30", log=tmp_path / "w.log")
    with grpc.insecure_channel(target) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        stream = stub.Generate(
            worker_pb2.GenerateRequest(prompt="drain", sampling=sampling(max_new_tokens=200, ignore_eos=True))
        )
        first = next(stream)
        proc.send_signal(__import__("signal").SIGTERM)
        rest = list(stream)
        tokens = len(first.token_ids) + sum(len(r.token_ids) for r in rest)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and tokens == 200
    assert proc.wait(30) == 0


def test_cli_generate_streams_to_the_terminal(worker: str) -> None:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "glm5_cli", "generate", "--target", worker, "--max-new-tokens", "5", "hello"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "5 generated tokens" in out.stderr
    assert time.monotonic() - start < 60


def test_cli_generate_structured_output(worker: str, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))  # fmt: skip
    base = [sys.executable, "-m", "glm5_cli", "generate", "--target", worker, "--max-new-tokens", "20", "hello"]
    out = subprocess.run([*base, "--json-schema", f"@{schema}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) in ({"ok": True}, {"ok": False})
    out = subprocess.run([*base, "--regex", "[xyz]{3}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and re.fullmatch("[xyz]{3}", out.stdout.strip()), out
    bad = subprocess.run([*base, "--regex", "[oops"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "regex" in bad.stderr
