"""Rank 0's side of a replica: start the other ranks, send them each step, keep them alive while idle, stop them.

Every failure to reach a follower (it died, it hung past the collective timeout) is a ReplicaFailure: the
engine fails what is in flight and the worker exits non-zero, so Kubernetes restarts the whole replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
from multiprocessing.process import BaseProcess
from typing import Any

import torch
from glm5.parallel import CommStats, TensorParallel

from glm5_worker.config import EngineConfig
from glm5_worker.parallel.follower import STOP_WAIT_S, WeightsOutcome, spawn_followers
from glm5_worker.parallel.protocol import Draft, LoadWeights, Message, Stats, Step, Stop, SwapWeights, Tick
from glm5_worker.parallel.replica import (
    Replica,
    ReplicaFailure,
    join,
    loopback_only,
    rendezvous,
    use_loopback_for_gloo,
    wait_for_ranks,
)
from glm5_worker.resolved import ResolvedConfig
from glm5_worker.runner.plan import RankMemory, StepPlan
from glm5_worker.runner.weights import WeightSource

log = logging.getLogger(__name__)


def threads_per_rank(config: EngineConfig) -> int:
    """CPU threads each rank of this host may use: the host's cores split between its ranks (0: leave torch's
    default, as OMP_NUM_THREADS says)."""
    if "OMP_NUM_THREADS" in os.environ:
        return 0
    return max(1, (os.cpu_count() or 1) // config.ranks_per_node)


class ReplicaDriver:
    def __init__(self, replica: Replica, followers: list[BaseProcess], listener: socket.socket | None = None) -> None:
        self.replica = replica
        self.followers = followers
        self._listener = listener  # the rendezvous store serves on it: it must stay open
        self.heartbeat_s = min(5.0, replica.config.collective_timeout_s / 4)
        self._last_sent = time.monotonic()
        self._closed = False
        self.control = CommStats()  # rank 0's time sending messages (bytes are not counted: they are pickled)

    @property
    def tp(self) -> TensorParallel:
        return self.replica.tp

    @property
    def device(self) -> torch.device:
        return self.replica.device

    def step(self, plan: StepPlan) -> None:
        self._send(Step(plan))

    def draft(self, message: Draft) -> None:
        self._send(message)

    def tick(self, demotions: list[tuple[int, int]]) -> None:
        """While idle: demotions at once, and a heartbeat at least every heartbeat_s."""
        self.check_followers()
        if demotions or time.monotonic() - self._last_sent >= self.heartbeat_s:
            self._send(Tick(demotions))

    def stats(self, mine: RankMemory) -> list[RankMemory]:
        self._send(Stats())
        return self._call(self.replica.channel.gather, mine)  # type: ignore[no-any-return]

    def load_weights(self, source: WeightSource, tokenizer_fingerprint: str) -> None:
        self._send(LoadWeights(source, tokenizer_fingerprint))

    def agree_weights(self, version: int, mine: WeightsOutcome) -> list[WeightsOutcome]:
        """Every rank's read outcome (rank 0's first); each rank swaps only if all of them read fine."""
        self._send(SwapWeights(version))
        return self._call(self.replica.channel.gather, mine, True)  # type: ignore[no-any-return]

    def check_followers(self) -> None:
        for proc in self.followers:
            if proc.exitcode is not None:
                raise ReplicaFailure(f"{proc.name} exited with code {proc.exitcode}")

    def close(self) -> None:
        """Stops the followers (they exit 0 on Stop) and leaves the process groups."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ReplicaFailure):  # already broken: the followers exit on their own
            self._send(Stop())
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.followers:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1)
        if all(proc.exitcode == 0 for proc in self.followers):
            self.replica.close()  # with a lost peer, tearing the groups down can block: the process exits anyway

    def _send(self, msg: Message) -> None:
        start = time.perf_counter()
        self._call(self.replica.channel.send, msg)
        self.control.calls += 1
        self.control.seconds += time.perf_counter() - start
        self._last_sent = time.monotonic()

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ReplicaFailure:
            raise
        except Exception as exc:  # gloo/nccl/hccl raise RuntimeError subclasses on a lost peer or a timeout
            raise ReplicaFailure(f"lost contact with the replica's other ranks: {exc}") from exc


def start_replica(rc: ResolvedConfig) -> ReplicaDriver:
    """Rank 0 on the first host: starts this host's other ranks, waits for every rank of the replica, joins."""
    config = rc.engine
    listener = None
    if loopback_only(config):
        use_loopback_for_gloo()
        listener = socket.socket()
        listener.bind(("127.0.0.1", config.master_port))  # port 0: any free one
        listener.listen(128)
        config = dataclasses.replace(config, master_addr="127.0.0.1")
    port = listener.getsockname()[1] if listener is not None else config.master_port
    followers = spawn_followers(config, port, first_local=1, threads=threads_per_rank(config))
    driver_followers = followers

    def check() -> None:
        for proc in driver_followers:
            if proc.exitcode is not None:
                raise ReplicaFailure(f"{proc.name} exited with code {proc.exitcode} while starting")

    try:
        store = rendezvous(config, 0, port, listener)
        wait_for_ranks(store, config.tensor_parallel_size, config.startup_timeout_s, check)
        replica = join(config, 0, rc.device_for(0), store)
    except BaseException:
        for proc in followers:
            proc.kill()
        raise
    return ReplicaDriver(replica, followers, listener)
