"""The RL loop end to end on localhost: two real `glm5 worker` processes, the TITO gateway (in this process), the
trainer (transformers' model) stepping on rollouts and pushing weights back with UpdateWeights under load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
from glm5.client import sampling
from glm5.model.presets import SHIPPED_MODEL
from glm5.rl.buffer import STREAM, InProcessBuffer, RedisBuffer
from glm5.v1 import tito_pb2, tito_pb2_grpc
from glm5_tito.gateway import GatewayConfig
from glm5_tito.server import start_gateway
from glm5_trainer.config import RLConfig
from glm5_trainer.loop import RLRun
from safetensors.torch import load_file

from tests.helpers.procs import ADMIN_ENV, ADMIN_TOKEN, admin_flags, start_redis, start_worker, stop

FLAGS = ("--max-model-len", "256", "--kv-cache-bytes", "32MiB")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, object]]:
    flags = (*FLAGS, *admin_flags(tmp_path_factory.getbasetemp()))  # every test's tmp_path is under it
    procs = [start_worker(SHIPPED_MODEL, *flags), start_worker(SHIPPED_MODEL, *flags)]
    engines = tuple(t for _, t in procs)
    server, gw, port = await start_gateway(GatewayConfig(engines=engines, heartbeat_s=0.5), InProcessBuffer(),
                                           "127.0.0.1", 0)  # fmt: skip
    try:
        yield {"gateway": f"127.0.0.1:{port}", "engines": engines, "gw": gw}
    finally:
        await server.stop(1)
        await gw.close()
        for p, _ in procs:
            stop(p)


def _config(stack: dict[str, object], out: Path, **kw: object) -> RLConfig:
    base: dict[str, object] = dict(
        policy=SHIPPED_MODEL, gateway=stack["gateway"], out=out, engines=stack["engines"], steps=3, group_size=4,
        groups_per_step=2, max_inflight_groups=6, temperature=2.0, learning_rate=1e-3, staleness_limit=0,
        eval_size=16, progress=False, admin_token=ADMIN_TOKEN, max_new_tokens=20,
    )  # fmt: skip
    return RLConfig(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.asyncio(loop_scope="module")
async def test_rollout_logprobs_equal_the_trainers_recomputation(stack: dict[str, object], tmp_path: Path) -> None:
    run = RLRun(_config(stack, tmp_path))
    async with grpc.aio.insecure_channel(str(stack["gateway"])) as ch:
        run.gateway = tito_pb2_grpc.TitoGatewayStub(ch)
        await asyncio.gather(*(run.rollout_group() for _ in range(2)))
        records = (
            await run.gateway.TakeRollouts(tito_pb2.TakeRolloutsRequest(max_records=100, timeout_ms=1000))
        ).records
    assert len(records) == 8 and {r.status for r in records} <= {tito_pb2.ROLLOUT_STATUS_COMPLETED,
                                                                 tito_pb2.ROLLOUT_STATUS_TRUNCATED}  # fmt: skip
    recomputed = run.policy.recompute(list(records))
    worst = 0.0
    for r, trainer_lp in zip(records, recomputed, strict=True):
        engine_lp = [lp for lp, m in zip(r.logprobs, r.loss_mask, strict=True) if m]
        assert len(engine_lp) == len(trainer_lp) > 0
        worst = max(worst, max(abs(a - b) for a, b in zip(engine_lp, trainer_lp, strict=True)))
    assert worst < 1e-3, f"engine and trainer log-probs differ by {worst} under the same weights (float32)"


@pytest.mark.asyncio(loop_scope="module")
async def test_multi_turn_rollouts_stick_and_the_trainer_scores_them(stack: dict[str, object], tmp_path: Path) -> None:
    """Three-turn rollouts (an environment appends tool output between turns): every turn goes to the rank of
    the first, and the trainer's log-probs of the model tokens equal the engines' (tool tokens masked out)."""
    run = RLRun(_config(stack, tmp_path, eval_size=0))
    tok = run.driver.tok
    async with grpc.aio.insecure_channel(str(stack["gateway"])) as ch:
        gateway = tito_pb2_grpc.TitoGatewayStub(ch)
        served = max((await run.fleet.live_engines()).values())
        records = []
        for i in range(6):
            rid, context, seen = f"mt-{i}", tok.encode(tok.apply_chat_template(
                [{"role": "user", "content": f"What is {i} + {i + 1}?"}], enable_thinking=True)), []  # fmt: skip
            for turn in range(3):
                params = sampling(temperature=1.0, max_new_tokens=8, seed=i * 10 + turn)
                req = tito_pb2.TurnRequest(rollout_id=rid, group_id="mt", context_token_ids=context, sampling=params)
                out = [r async for r in gateway.Turn(req, timeout=120)]
                seen.append({r.rank for r in out})
                context = context + [t for r in out for t in r.token_ids] + tok.encode(f"\ntool output {turn}\n")
            assert all(s == seen[0] for s in seen), f"rollout {rid} moved between ranks: {seen}"
            records.append(await gateway.FinishRollout(tito_pb2.FinishRolloutRequest(
                rollout_id=rid, reward=1.0, status=tito_pb2.ROLLOUT_STATUS_COMPLETED)))  # fmt: skip
    assert served == 0  # this module's earlier tests push no weights: trainer and engines hold the same ones
    for r, trainer_lp in zip(records, run.policy.recompute(records), strict=True):
        assert sum(r.loss_mask) == len(trainer_lp) and 0 in r.loss_mask[r.prompt_tokens :]  # tool tokens
        engine_lp = [lp for lp, m in zip(r.logprobs, r.loss_mask, strict=True) if m]
        assert max(abs(a - b) for a, b in zip(engine_lp, trainer_lp, strict=True)) < 1e-3


@pytest.mark.asyncio(loop_scope="module")
async def test_async_loop_syncs_under_load_and_filters_stale_samples(stack: dict[str, object], tmp_path: Path) -> None:
    run = RLRun(_config(stack, tmp_path / "async", staleness_limit=1))
    before = {k: v.clone() for k, v in run.policy.model.state_dict().items()}
    result = await run.run()
    # weight syncs happened while rollouts were generating, and none of them failed or was lost
    assert result.counters.get("rollouts_failed", 0) == 0 and result.counters.get("rollouts_lost", 0) == 0
    assert len(result.sync_seconds) == 3 and result.final_version == 3 == result.history[-1]["version"]
    # the producer runs ahead of the trainer by at most tau = 1 versions: overlap, and nothing generated in vain
    assert result.counters.get("dropped_stale", 0) == 0
    assert all(row["max_staleness"] <= 1 for row in result.history)
    # the engines serve what the trainer published: the final checkpoint's weights differ from the start
    after = run.policy.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert result.history[0]["mismatch"] < 1e-3  # step 1 trains on version-0 samples with version-0 weights
    for name in ("summary.json", "history.jsonl", "rl.png"):
        assert (tmp_path / "async" / name).stat().st_size > 0
    assert Path(result.final_checkpoint, "model.safetensors").is_file()
    assert result.accuracy_before is not None and result.accuracy_after is not None


@pytest.mark.asyncio(loop_scope="module")
async def test_stale_samples_are_filtered(stack: dict[str, object], tmp_path: Path) -> None:
    run = RLRun(_config(stack, tmp_path / "sync", mode="sync", steps=2, eval_size=0))
    async with grpc.aio.insecure_channel(str(stack["gateway"])) as ch:  # 2 groups on the engines' version 3
        run.gateway = tito_pb2_grpc.TitoGatewayStub(ch)
        await asyncio.gather(*(run.rollout_group() for _ in range(2)))
    result = await run.run()
    # the run starts by pushing its policy as version 4: the 8 version-3 samples are more than tau = 0 behind
    assert result.counters["dropped_stale"] == 8
    assert all(row["max_staleness"] == 0 for row in result.history)
    assert result.counters["rollouts_completed"] + result.counters.get("rollouts_truncated", 0) == 8 + 2 * 2 * 4
    # the engines already serve version 3 from the run above: this run numbers its versions above it, after
    # pushing its starting policy as version 4
    assert [row["version"] for row in result.history] == [5, 6] and result.final_version == 6
    assert len(result.sync_seconds) == 3 and result.accuracy_before is None


@pytest.mark.asyncio(loop_scope="module")
async def test_trainer_reads_the_redis_stream(stack: dict[str, object], tmp_path: Path) -> None:
    """With Redis, the gateway writes records to the `glm5:rollouts` stream and the trainer reads it directly;
    a record of another run in the stream is skipped and counted."""
    redis_proc, url = start_redis(tmp_path)
    buffer = RedisBuffer(url)
    await buffer.put(tito_pb2.RolloutRecord(rollout_id="x", group_id="another-run-g1"))
    server, gw, port = await start_gateway(GatewayConfig(engines=stack["engines"], heartbeat_s=0.5), buffer,
                                           "127.0.0.1", 0)  # type: ignore[arg-type]  # fmt: skip
    try:
        config = _config({**stack, "gateway": f"127.0.0.1:{port}"}, tmp_path / "out", mode="sync", steps=1,
                         eval_size=0, redis_url=url)  # fmt: skip
        result = await RLRun(config).run()
        assert result.counters["dropped_foreign"] == 1 and result.trained_samples == 2 * 4
        assert await buffer.redis.xlen(STREAM) == 1 + 2 * 4
    finally:
        await server.stop(1)
        await gw.close()
        stop(redis_proc)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_restarted_trainer_resumes_from_its_last_version(stack: dict[str, object], tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    first = await RLRun(_config(stack, tmp_path / "job", mode="sync", steps=1, eval_size=0, completion_file=log)).run()
    assert json.loads(log.read_text()) == {"complete": True, "steps": 1, "version": first.final_version}
    log.unlink()
    # an RLJob pod restarted with the same checkpoint volume, the job's steps raised from 1 to 2
    config = _config(stack, tmp_path / "job", mode="sync", steps=2, eval_size=0, completion_file=log)
    second = RLRun(config)
    assert second.resumed_from is not None and second.resumed_from[0] == first.final_version
    assert second.versions.steps == 1  # the job's steps so far, recorded with the published version
    name = "model.embed_tokens.weight"
    saved = load_file(str(Path(first.final_checkpoint, "model.safetensors")))[name]
    assert torch.equal(second.policy.model.state_dict()[name], saved)  # not the starting checkpoint's weights
    # and the optimizer continues with the moments it had at that version, not a fresh AdamW
    moments = second.policy.optimizer.state_dict()["state"]
    kept = torch.load(tmp_path / "job" / "trainer_state.pt", weights_only=True)
    assert kept["version"] == first.final_version and moments
    assert all(torch.equal(moments[k]["exp_avg"], kept["optimizer"]["state"][k]["exp_avg"]) for k in moments)
    result = await second.run()
    # the engines already serve the resumed version: nothing to push first; numbering continues; one step
    # brings the job to its 2 steps
    assert [(row["version"], row["job_step"]) for row in result.history] == [(first.final_version + 1, 2)]
    assert len(result.sync_seconds) == 1
    summary = (tmp_path / "job" / "summary.json").read_text()
    # restarted once more after the job is done: nothing is trained, pushed or overwritten
    log.unlink()
    done = await RLRun(config).run()
    assert done.history == [] and done.final_version == result.final_version
    assert (tmp_path / "job" / "summary.json").read_text() == summary
    assert json.loads(log.read_text())["steps"] == 2  # reported again, for the restarted container's log


@pytest.mark.asyncio(loop_scope="module")
async def test_an_engine_that_does_not_answer_is_skipped(stack: dict[str, object], tmp_path: Path) -> None:
    """A worker that is down (restarting under its Service) does not stop the trainer: probes, evaluation and
    weight pushes go to the engines that answer, and it is counted."""
    dead = "127.0.0.1:1"
    engines = (*stack["engines"], dead)  # type: ignore[misc]
    result = await RLRun(_config({**stack, "engines": engines}, tmp_path, mode="sync", steps=1, eval_size=4)).run()
    assert result.counters["engines_unreachable"] >= 4  # adopt, evaluate before/after, the push
    assert len(result.history) == 1 and result.accuracy_after is not None


@pytest.mark.asyncio(loop_scope="module")
async def test_trainer_process_trains_until_sigterm_then_publishes(stack: dict[str, object], tmp_path: Path) -> None:
    """`glm5 trainer --steps 0` (an RLJob pod) trains until SIGTERM, then finishes the step, pushes it, writes its
    summary and exits 0; a bad setting exits 2 with the reason."""
    engines = [f for e in stack["engines"] for f in ("--engine", e)]  # type: ignore[attr-defined]
    cmd = [sys.executable, "-m", "glm5_cli", "trainer", "--policy", str(SHIPPED_MODEL), "--gateway",
           str(stack["gateway"]), *engines, "--checkpoint-dir", str(tmp_path), "--mode", "sync", "--group-size", "2",
           "--groups-per-step", "2", "--eval-size", "0", "--no-progress", "--admin-token-env", ADMIN_ENV]  # fmt: skip
    env = {**os.environ, ADMIN_ENV: ADMIN_TOKEN.value}
    bad = await asyncio.to_thread(subprocess.run, [*cmd, "--lr-schedule", "cosine", "--steps", "0"],
                                  capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert bad.returncode == 2 and "the cosine schedule needs a number of steps" in bad.stderr
    proc = subprocess.Popen([*cmd, "--steps", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(600):  # until it has published two steps (the gateway runs in this event loop)
            if len(list((tmp_path / "actor_synced").glob("v*[0-9]"))) >= 3:
                break
            await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.to_thread(proc.communicate, timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    newest = max(int(d.name[1:]) for d in (tmp_path / "actor_synced").glob("v*[0-9]"))
    assert summary["final_version"] == newest and summary["trained_samples"] >= 2 * 2 * 2
    assert "held-out accuracy n/a -> n/a" in out
