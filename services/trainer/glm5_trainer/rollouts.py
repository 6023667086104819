"""The environment side of the RL loop: GRPO groups of rollouts through the TITO gateway, rewarded by the
environment and finished into the rollout buffer.

In the asynchronous loop the producer runs in its own process (`ProducerProcess`), as environments do in a
cluster: driving a hundred token streams is Python work that would otherwise compete with the training step
for the trainer's interpreter. The trainer tells it how many steps are done (the staleness bound) and it tells
the trainer which groups finished and how many records each wrote.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import multiprocessing
import os
import random
from collections.abc import Callable, Coroutine
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import grpc
from glm5.client import sampling
from glm5.security import channel as secure_channel
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import tito_pb2, tito_pb2_grpc

from glm5_trainer.environment import ExactAnswer, Problem, environment, load_problems, prompt_ids, read_turn

if TYPE_CHECKING:
    from glm5_trainer.config import RLConfig

log = logging.getLogger(__name__)


class RolloutDriver:
    def __init__(self, config: RLConfig, run_id: str, on_group: Callable[[str, int], None]) -> None:
        self.c = config
        self.run_id = run_id
        self.on_group = on_group  # (group id, records its rollouts wrote to the buffer)
        self.env: ExactAnswer = environment(config.environment)
        self.train_problems, self.eval_problems = load_problems(config.dataset, self.env, seed=config.split_seed)
        self.tok = Tokenizer(config.policy)
        self.rng = random.Random(config.seed)
        self.counters: collections.Counter[str] = collections.Counter()
        self.gateway: tito_pb2_grpc.TitoGatewayStub | None = None
        self.groups = 0  # groups started
        self.steps_done = 0
        self._stepped = asyncio.Event()
        self._prompts: dict[str, list[int]] = {}

    def prompt_ids(self, p: Problem) -> list[int]:
        if p.id not in self._prompts:
            self._prompts[p.id] = prompt_ids(self.tok, p)
        return self._prompts[p.id]

    def advance(self, steps_done: int) -> None:
        """The trainer finished (and pushed) this many steps: groups started from now on get those weights."""
        self.steps_done = steps_done
        self._stepped.set()

    async def _rollout(self, p: Problem, group_id: str, rollout_id: str, seed: int) -> bool:
        assert self.gateway is not None
        gateway, turns = self.gateway, 0

        async def turn(context: list[int]) -> tuple[list[int], bool]:
            nonlocal turns
            request = tito_pb2.TurnRequest(
                rollout_id=rollout_id, group_id=group_id, context_token_ids=context,
                sampling=sampling(temperature=self.c.temperature, max_new_tokens=self.c.max_new_tokens,
                                  seed=seed + turns),
                stream_interval=self.c.max_new_tokens,  # the environment reads whole turns: one message per turn
            )  # fmt: skip
            turns += 1
            return await read_turn(gateway.Turn(request))

        try:
            outcome = await self.env.play(p, self.prompt_ids(p), turn, self.tok)
            status = tito_pb2.ROLLOUT_STATUS_TRUNCATED if outcome.truncated else tito_pb2.ROLLOUT_STATUS_COMPLETED
            reward = outcome.reward
            calls = {"tool_calls": outcome.calls, "tool_calls_unknown": outcome.unknown,
                     "tool_calls_malformed": outcome.malformed}  # fmt: skip
            self.counters.update({k: v for k, v in calls.items() if v})
        except grpc.aio.AioRpcError as exc:
            log.warning("rollout %s failed: %s %s", rollout_id, exc.code().name, exc.details())
            status, reward = tito_pb2.ROLLOUT_STATUS_FAILED, 0.0
        try:
            await gateway.FinishRollout(
                tito_pb2.FinishRolloutRequest(rollout_id=rollout_id, reward=reward, status=status)
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("rollout %s: FinishRollout failed: %s", rollout_id, exc.code().name)
            self.counters["rollouts_lost"] += 1
            return False
        self.counters[f"rollouts_{tito_pb2.RolloutStatus.Name(status).removeprefix('ROLLOUT_STATUS_').lower()}"] += 1
        return True

    def rollout_group(self) -> Coroutine[Any, Any, None]:
        """One GRPO group: `group_size` rollouts of one problem, spread over ranks by their ids. Numbered and
        counted when called (not when first scheduled), so the producer's staleness bound sees it at once."""
        self.groups += 1
        group_id = f"{self.run_id}-g{self.groups}"
        p = self.rng.choice(self.train_problems)
        seeds = [self.rng.getrandbits(31) for _ in range(self.c.group_size)]
        return self._run_group(p, group_id, seeds)

    async def _run_group(self, p: Problem, group_id: str, seeds: list[int]) -> None:
        done = await asyncio.gather(*(self._rollout(p, group_id, f"{group_id}-r{i}", s) for i, s in enumerate(seeds)))
        self.on_group(group_id, sum(done))

    async def produce(self, stop: asyncio.Event) -> None:
        """Keep up to `max_inflight_groups` groups generating until `stop` is set."""
        slots = asyncio.Semaphore(self.c.max_inflight_groups)
        running: set[asyncio.Task[None]] = set()

        async def one(group: Coroutine[Any, Any, None]) -> None:
            try:
                await group
            finally:
                slots.release()

        try:
            while not stop.is_set():
                await slots.acquire()
                # Staleness-bounded: group n is trained on at step n // groups_per_step + 1, so starting it
                # only once that is at most staleness_limit steps away keeps every sample usable (nothing
                # generated just to be dropped as stale).
                while (
                    self.groups >= (self.steps_done + self.c.staleness_limit + 1) * self.c.groups_per_step
                    and not stop.is_set()
                ):
                    self._stepped.clear()
                    await self._stepped.wait()
                if stop.is_set():
                    break
                task = asyncio.create_task(one(self.rollout_group()))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            # Let the groups in flight finish (their ledgers close cleanly), then stop.
            if running:
                await asyncio.wait(running, timeout=120)
            for task in running:
                task.cancel()


# -- the producer process ---------------------------------------------------------------------------------


def _producer_main(config: RLConfig, run_id: str, conn: Connection) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_produce(config, run_id, conn))


async def _produce(config: RLConfig, run_id: str, conn: Connection) -> None:
    driver = RolloutDriver(config, run_id, lambda gid, n: conn.send(("group", gid, n, dict(driver.counters))))
    stop, go = asyncio.Event(), asyncio.Event()

    def readable() -> None:
        while conn.poll():
            message = conn.recv()
            if message[0] == "steps":
                driver.advance(message[1])
            elif message[0] == "go":
                go.set()
            else:  # "stop"
                stop.set()
                go.set()
                driver.advance(driver.steps_done)

    asyncio.get_running_loop().add_reader(conn.fileno(), readable)
    async with secure_channel(config.gateway, config.tls) as channel:
        driver.gateway = tito_pb2_grpc.TitoGatewayStub(channel)  # type: ignore[no-untyped-call]
        await channel.channel_ready()
        conn.send(("ready", dict(driver.counters)))
        await go.wait()
        await driver.produce(stop)
    conn.send(("done", dict(driver.counters)))


class ProducerProcess:
    """The producer in a child process, driven over a pipe from the trainer's event loop."""

    def __init__(self, config: RLConfig, run_id: str, on_group: Callable[[str, int], None]) -> None:
        self.on_group = on_group
        self.gateway = config.gateway
        self.counters: dict[str, int] = {}
        self._ready = asyncio.Event()
        self._done = asyncio.Event()
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch and gRPC threads
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_producer_main, args=(config, run_id, child), daemon=True)
        self.process.start()
        child.close()
        if config.producer_cpus:  # its threads start later and inherit this
            os.sched_setaffinity(self.process.pid, set(config.producer_cpus))  # type: ignore[arg-type]
        asyncio.get_running_loop().add_reader(self._conn.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            while self._conn.poll():
                message = self._conn.recv()
                self.counters = message[-1]
                if message[0] == "group":
                    self.on_group(message[1], message[2])
                elif message[0] == "ready":
                    self._ready.set()
                else:  # "done"
                    self._done.set()
        except EOFError:  # the child is gone
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._ready.set()
            self._done.set()

    async def start(self, timeout: float = 300.0) -> None:
        """Waits until the child has imported, tokenised its prompts and reached the gateway (a one-off cost
        of seconds, like starting an environment server), then lets it produce."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            self.process.kill()
            raise RuntimeError(
                f"the rollout producer process did not reach the gateway at {self.gateway} within {timeout:.0f} s"
            ) from None
        if not self.alive:
            raise RuntimeError("the rollout producer process exited before it was ready (its log is above)")
        self._conn.send(("go",))

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def advance(self, steps_done: int) -> None:
        self._conn.send(("steps", steps_done))

    async def stop(self, timeout: float = 150.0) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(("stop",))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._done.wait(), timeout)
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
        await asyncio.to_thread(self.process.join, 10)
        if self.process.is_alive():
            self.process.kill()
        self._conn.close()
