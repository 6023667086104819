"""The RL loop: environments drive rollouts through the TITO gateway, finished rollouts reach the trainer through
the rollout buffer, the trainer steps on selected samples and pushes new weights back to the rollout engines.

- async (default): a producer keeps `max_inflight_groups` GRPO groups generating at all times, with whatever
  weights the engines hold; the trainer takes complete groups as they finish, drops the ones more than
  `staleness_limit` versions behind (the importance-sampling loss corrects the rest), and weight syncs happen
  under load (in-flight requests continue; every token carries the version that produced it).
- sync: generate `groups_per_step` groups, wait for all, train, sync, repeat (the baseline the benchmark
  compares against).

Held-out accuracy is measured greedily on the engines (the synced weights) before, during (`eval_every`) and
after training. `history.jsonl`, `summary.json` and a reward/accuracy plot (`rl.png`) go to the output folder.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import random
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from glm5.client import WorkerClient, sampling
from glm5.rl.buffer import RedisBuffer
from glm5.rl.samples import oldest_version, select
from glm5.security import channel as secure_channel
from glm5.v1 import tito_pb2, tito_pb2_grpc, worker_pb2

from glm5_trainer.config import Result, RLConfig
from glm5_trainer.distributed import World
from glm5_trainer.environment import Outcome, Problem, evaluation_summary, read_turn
from glm5_trainer.fleet import EngineFleet
from glm5_trainer.outputs import write_outputs
from glm5_trainer.policy import Policy, StepStats
from glm5_trainer.ranks import Ranks
from glm5_trainer.rollouts import ProducerProcess, RolloutDriver
from glm5_trainer.versions import WeightVersions, steps_recorded

log = logging.getLogger(__name__)


def latest_published(out: Path) -> tuple[int, Path] | None:
    """The newest complete actor_synced checkpoint under `out` (publishing is atomic: `.tmp` folders are not)."""
    versions = []
    for d in (out / "actor_synced").glob("v*"):
        if d.is_dir() and d.name[1:].isdigit() and (d / "config.json").is_file():
            versions.append((int(d.name[1:]), d))
    return max(versions) if versions else None


def finished(config: RLConfig) -> tuple[int, int] | None:
    """(version, steps) when the job has already taken its `steps` (a trainer restarted after it finished; a
    StatefulSet restarts every container that exits), else None. Read from the published versions alone, so
    every host can tell before any rank starts: a finished job needs no rendezvous."""
    latest = latest_published(config.out)
    if not config.steps or latest is None:
        return None
    recorded = steps_recorded(latest[1])
    steps = recorded if recorded is not None else latest[0]
    return (latest[0], steps) if steps >= config.steps else None


def report_finished(config: RLConfig, version: int, steps: int) -> None:
    """The completion an RLJob's operator reads (the container's termination message)."""
    if config.completion_file is not None:
        done = {"complete": True, "steps": steps, "version": version}
        config.completion_file.write_text(json.dumps(done) + "\n")


@dataclass
class Trainer:
    """What every trainer rank builds the same way: the policy (sharded over the world), its weight versions,
    and where a restarted job resumes."""

    ranks: Ranks
    resumed_from: tuple[int, Path] | None
    steps_done: int
    exact_resume: bool


def open_trainer(config: RLConfig, world: World) -> Trainer:
    """The policy and its versions on this rank. A restarted trainer (an RLJob pod) resumes from its last
    published version, not from the start; the optimizer state saved with that version too, when there is
    one (rank 0 and the other ranks call this alike: the resume's reads are collective)."""
    resumed_from = latest_published(config.out)
    start = config.policy if resumed_from is None else resumed_from[1]
    # `steps` counts the job's steps across restarts; versions published before they were recorded count one
    # step per version (0 is a real count: the starting policy published above the engines' version)
    recorded = None if resumed_from is None else steps_recorded(start)
    done = 0 if resumed_from is None else recorded if recorded is not None else resumed_from[0]
    policy = Policy(start, config.learning_rate, config.region, config.balance_weight, config.entropy_weight,
                    total_steps=config.steps if config.lr_schedule == "cosine" else None, steps_done=done,
                    world=world, activation_checkpointing=config.activation_checkpointing,
                    expert_parallel=config.expert_parallel)  # fmt: skip
    versions = WeightVersions(policy.model, config.out, config.policy, config.sync_every_steps,
                              config.sync_interval_s, config.ema_decay, steps=done)  # fmt: skip
    # one rank: the optimizer's state as one file; several: a DCP directory every rank writes its part of
    state_path = config.out / ("trainer_state.pt" if world.size == 1 else "trainer_state")
    ranks = Ranks(policy, versions, state_path, world)
    exact = False
    if resumed_from is not None:
        versions.latest = versions.synced = resumed_from[0]
        exact = ranks.restore(resumed_from[0])
    return Trainer(ranks, resumed_from, done, exact)


class RLRun:
    def __init__(self, config: RLConfig, world: World | None = None) -> None:
        self.c = config
        self.world = world or World()
        self.run_id = f"{config.job}-{random.Random().getrandbits(32):08x}"  # rollout ids unique across runs
        self.driver = RolloutDriver(config, self.run_id, self._group_finished)
        self.env, self.eval_problems = self.driver.env, self.driver.eval_problems
        trainer = open_trainer(config, self.world)
        self.ranks, self.resumed_from = trainer.ranks, trainer.resumed_from
        self.policy, self.versions = self.ranks.policy, self.ranks.versions
        if self.resumed_from is not None:
            how = "with its optimizer state" if trainer.exact_resume else "with a fresh optimizer (none saved for it)"
            log.info("resuming from version %d (%s) after %d steps, %s", *self.resumed_from, trainer.steps_done, how)
        self.counters: collections.Counter[str] = collections.Counter()
        self.pending: dict[str, list[tito_pb2.RolloutRecord]] = collections.defaultdict(list)
        self.finished_groups: dict[str, int] = {}  # group id -> records its rollouts wrote
        self.history: list[dict[str, Any]] = []
        self.last_eval: dict[str, Any] | None = None
        self._pushing: asyncio.Task[None] | None = None
        self.gateway: tito_pb2_grpc.TitoGatewayStub | None = None
        self._buffer: RedisBuffer | None = None
        self._producer: ProducerProcess | None = None
        self._stop_requested = False
        self.phase = "starting"  # starting, evaluating, training, finishing, done
        self.fleet = EngineFleet(config, self.ranks, self.counters)

    def progress(self) -> dict[str, Any]:
        """What GET /status reports (the RLJob's status follows it)."""
        return {"phase": self.phase, "steps": self.versions.steps, "targetSteps": self.c.steps,
                "policyVersion": self.fleet.pushed_version, "lastSyncTime": self.fleet.last_sync_time,
                "trainerWorldSize": self.world.size}  # fmt: skip

    def request_stop(self) -> None:
        """Finish the current step, publish and push it, and end the run (SIGTERM on a trainer pod)."""
        self._stop_requested = True

    def _group_finished(self, group_id: str, records: int) -> None:
        self.finished_groups[group_id] = records

    def rollout_group(self) -> Coroutine[Any, Any, None]:
        """One group generated by this process's driver (the sync loop and tests)."""
        if self.driver.gateway is None:
            self.driver.gateway = self.gateway
        return self.driver.rollout_group()

    # -- the buffer -------------------------------------------------------------------------------------

    async def _take(self, n: int, timeout: float) -> list[tito_pb2.RolloutRecord]:
        if self._buffer is not None:
            return await self._buffer.take(n, timeout)
        assert self.gateway is not None
        resp = await self.gateway.TakeRollouts(
            tito_pb2.TakeRolloutsRequest(max_records=n, timeout_ms=int(timeout * 1000))
        )
        return list(resp.records)

    async def next_batch(self) -> list[tito_pb2.RolloutRecord]:
        """`groups_per_step` complete groups that pass selection (stale / failed / malformed samples dropped,
        groups with more than half valid padded)."""
        accepted: list[list[tito_pb2.RolloutRecord]] = []
        while len(accepted) < self.c.groups_per_step:
            if self._producer is not None and not self._producer.alive:
                raise RuntimeError("the rollout producer process exited (its log is above)")
            for r in await self._take(256, 0.5):
                if r.group_id.startswith(self.run_id + "-"):
                    self.pending[r.group_id].append(r)
                else:
                    self.counters["dropped_foreign"] += 1  # another run's record (a shared Redis stream)
            for gid in list(self.pending):
                if len(accepted) == self.c.groups_per_step:
                    break
                expected = self.finished_groups.get(gid)
                if expected is None or len(self.pending[gid]) < expected:
                    continue  # the group is still generating
                records = self.pending.pop(gid)
                del self.finished_groups[gid]
                sel = select(records, self.versions.latest, self.c.staleness_limit, self.c.group_size)
                self.counters.update({f"dropped_{k}": v for k, v in sel.dropped.items()})
                self.counters["padded"] += sel.padded
                if sel.samples:
                    accepted.append(sel.samples)
            for gid in [g for g, n in self.finished_groups.items() if n == 0]:
                del self.finished_groups[gid]  # every rollout of it was lost: nothing will arrive
        return [r for group in accepted for r in group]

    # -- engines ----------------------------------------------------------------------------------------

    async def evaluate(self, label: str = "held-out evaluation", leave: bool = True) -> float | None:
        """Greedy final-answer accuracy on the held-out problems, played out on the engines (the synced weights);
        the tool calls of the episodes go to `last_eval`. A progress bar counts the problems (200 take minutes)."""
        from tqdm import tqdm

        problems = self.eval_problems[: self.c.eval_size]
        if not problems:
            return None
        clients = [WorkerClient(e, self.c.tls, self.c.internal_token) for e in await self.fleet.live_engines()]
        slots = asyncio.Semaphore(32 * len(clients))

        async def one(i: int, p: Problem) -> Outcome:
            async def generate(context: list[int]) -> tuple[list[int], bool]:
                request = worker_pb2.GenerateRequest(
                    prompt_token_ids=context,
                    sampling=sampling(temperature=0.0, max_new_tokens=self.c.max_new_tokens),
                )  # fmt: skip
                async with slots:
                    return await read_turn(clients[i % len(clients)].generate(request, timeout=600))

            outcome = await self.env.play(p, self.driver.prompt_ids(p), generate, self.driver.tok)
            bar.update(1)
            return outcome

        bar = tqdm(total=len(problems), desc=label, unit="problem", leave=leave, disable=not self.c.progress)
        try:
            outcomes = await asyncio.gather(*(one(i, p) for i, p in enumerate(problems)))
        finally:
            bar.close()
            await asyncio.gather(*(c.close() for c in clients))
        self.last_eval = evaluation_summary(outcomes)
        return float(self.last_eval["accuracy"])

    def _release(self, step: int) -> None:
        """Groups started from now on get this step's weights (the producer's staleness bound moves on)."""
        if self._producer is not None:
            self._producer.advance(step)
        else:
            self.driver.advance(step)

    async def _push(self, path: Path, step: int) -> None:
        await self.fleet.sync(path)
        self._release(step)

    # -- the loop ---------------------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """The job has taken its `steps` (never, with steps 0)."""
        return bool(self.c.steps) and self.versions.steps >= self.c.steps

    async def run(self) -> Result:
        from tqdm.contrib.logging import logging_redirect_tqdm

        try:
            with logging_redirect_tqdm():  # this process's log lines print above the progress bars, not through them
                return await self._run()
        finally:
            self.fleet.close()
            self.ranks.stop()  # the other ranks exit (after a failure too: rank 0's exit status tells)

    async def _run(self) -> Result:
        from tqdm import tqdm

        if self.complete:
            # A trainer pod restarted after the job finished: the outputs of the run stay as they are.
            log.info("the job already took its %d steps (version %d): nothing to train", self.c.steps,
                     self.versions.synced)  # fmt: skip
            final = self.versions.synced_path(self.versions.synced)
            self._report_completion()
            return Result(None, None, 0.0, 0, self.versions.synced, str(final), {}, [], [])
        self.c.out.mkdir(parents=True, exist_ok=True)
        if self.c.redis_url:
            self._buffer = RedisBuffer(self.c.redis_url)
        async with secure_channel(self.c.gateway, self.c.tls) as channel:
            self.gateway = tito_pb2_grpc.TitoGatewayStub(channel)  # type: ignore[no-untyped-call]
            await self.fleet.adopt()
            self.phase = "evaluating"
            before = await self.evaluate("held-out evaluation before RL")
            eval_before = self.last_eval
            log.info("held-out accuracy before RL: %s (%s)", before, eval_before)
            self.driver.gateway = self.gateway
            if self.c.mode == "async":
                self._producer = ProducerProcess(self.c, self.run_id, self._group_finished)
                await self._producer.start()
            bar = tqdm(total=self.c.steps or None, initial=self.versions.steps, desc=f"RL ({self.c.mode})", unit="step",
                       disable=not self.c.progress)  # fmt: skip
            start = time.perf_counter()
            self.phase = "training"
            try:
                for step in itertools.count(1):
                    if self._stop_requested or self.complete:
                        break
                    t0 = time.perf_counter()
                    if self._producer is None:
                        await asyncio.gather(*(self.rollout_group() for _ in range(self.c.groups_per_step)))
                    samples = await self.next_batch()
                    t1 = time.perf_counter()
                    stats = await asyncio.to_thread(self.ranks.step, samples)
                    phases = {"wait_seconds": round(t1 - t0, 4), "step_seconds": round(time.perf_counter() - t1, 4)}
                    await self._after_step(step, stats, samples, start, bar, phases)
                self.phase = "finishing"
                if self._pushing is not None:
                    await self._pushing
                if self.versions.synced < self.versions.latest:
                    final = self.ranks.publish()
                    self.ranks.save_state(self.versions.synced)
                    await self.fleet.sync(final)
                train_seconds = time.perf_counter() - start
            finally:
                bar.close()
                if self._pushing is not None and not self._pushing.done():
                    self._pushing.cancel()
                if self._producer is not None:
                    await self._producer.stop()
                    self.counters.update(self._producer.counters)
                await asyncio.to_thread(self.ranks.wait_saved)
                self.counters.update(self.driver.counters)
            trainer = {"world_size": self.world.size, "rank_bytes": self.ranks.bytes_per_rank()}
            log.info("trainer: %d rank(s), state bytes per rank %s", self.world.size, trainer["rank_bytes"])
            self.phase = "evaluating"
            after = await self.evaluate("held-out evaluation after RL")
            log.info("held-out accuracy after RL: %s (%s)", after, self.last_eval)
        self.phase = "done"
        result = Result(
            accuracy_before=before, accuracy_after=after, train_seconds=train_seconds,
            trained_samples=len(self.history) * self.c.groups_per_step * self.c.group_size,
            final_version=self.versions.synced, final_checkpoint=str(self.versions.synced_path(self.versions.synced)),
            counters=dict(self.counters), sync_seconds=self.fleet.sync_seconds, history=self.history,
            evaluation_before=eval_before, evaluation_after=self.last_eval if after is not None else None,
            trainer=trainer,
        )  # fmt: skip
        write_outputs(self.c.out, result, self.c)
        if self.complete:
            self._report_completion()
        return result

    def _report_completion(self) -> None:
        report_finished(self.c, self.versions.synced, self.versions.steps)

    async def _after_step(
        self,
        step: int,
        stats: StepStats,
        samples: list[tito_pb2.RolloutRecord],
        start: float,
        bar: Any,
        phases: dict[str, float],
    ) -> None:
        t0 = time.perf_counter()
        # the checkpoint is written before the next step changes the weights
        path = self.ranks.publish() if self.versions.due() else None
        if path is not None:
            self.ranks.save_state(self.versions.synced)
        phases["publish_seconds"] = round(time.perf_counter() - t0, 4)
        t0 = time.perf_counter()
        if self._pushing is not None:
            await self._pushing  # versions reach the engines in order
            self._pushing = None
        phases["push_wait_seconds"] = round(time.perf_counter() - t0, 4)
        if path is not None and self.c.mode == "async" and self.c.weights_transport != "collective":
            # The push overlaps the next training step; groups started after it get the new weights. A collective
            # sync sends the live weights, which the next step changes, and every rank takes part in it in the
            # order rank 0 sends its commands: it runs here, between the steps.
            self._pushing = asyncio.create_task(self._push(path, step))
        elif path is not None:
            await self._push(path, step)
        else:
            self._release(step)
        due = self.c.eval_every and step % self.c.eval_every == 0
        accuracy = await self.evaluate(f"held-out evaluation at step {step}", leave=False) if due else None
        evaluation = {"evaluation": self.last_eval} if accuracy is not None else {}
        oldest = min(oldest_version(r) for r in samples)
        row = {"step": step, "job_step": self.versions.steps, "seconds": round(time.perf_counter() - start, 3),
               "version": self.versions.latest,
               "max_staleness": self.versions.latest - 1 - oldest, **asdict(stats), **phases, "accuracy": accuracy,
               "sync_seconds": self.fleet.sync_seconds[-1] if self.fleet.sync_seconds else None,
               **evaluation}  # fmt: skip
        self.history.append(row)
        postfix = {"reward": f"{stats.reward:.2f}"}
        if accuracy is not None:
            postfix["acc"] = f"{accuracy:.1%}"
        bar.set_postfix(postfix)
        bar.update(1)
        log.debug("step %s", row)
