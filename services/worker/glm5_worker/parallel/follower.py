"""Ranks 1..N-1 of a replica: load a shard, then run whatever rank 0 sends, step by step. No scheduler, no server.

A follower exits non-zero as soon as anything fails (a collective times out or loses a peer, a step raises),
and within a second of the process that started it going away: it never outlives its rank 0.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp
from glm5.model.model import GlmMoeDsaForCausalLM
from glm5.serving import freeze_heap

from glm5_worker.config import EngineConfig
from glm5_worker.parallel.protocol import Draft, LoadWeights, Stats, Step, Stop, SwapWeights, Tick
from glm5_worker.parallel.replica import Replica, join, rank_of, rendezvous
from glm5_worker.resolved import ResolvedConfig, resolve
from glm5_worker.runner.model_runner import ModelRunner
from glm5_worker.runner.threads import in_own_thread
from glm5_worker.runner.weights import read_weights

log = logging.getLogger(__name__)
WeightsOutcome = tuple[bool, str]  # (read fine, error message)
STOP_WAIT_S = 10.0


class Follower:
    def __init__(self, runner: ModelRunner, replica: Replica, rc: ResolvedConfig) -> None:
        self.runner, self.replica, self.rc = runner, replica, rc
        self._reading: Future[GlmMoeDsaForCausalLM] | None = None
        self._draft_out: torch.Tensor | None = None  # the last MTP pass's output rows (the next pass reads them)

    def run(self) -> int:
        channel = self.replica.channel
        while True:
            msg = channel.recv()
            if isinstance(msg, Step):
                if msg.plan.demotions:
                    self.runner.demote(msg.plan.demotions)
                self.runner.execute(msg.plan)
            elif isinstance(msg, Draft):
                self._draft(msg)
            elif isinstance(msg, Tick):
                if msg.demotions:
                    self.runner.demote(msg.demotions)
            elif isinstance(msg, LoadWeights):
                read = functools.partial(read_weights, msg.source, self.rc.model, self.rc.dtype,
                                         self.runner.device, msg.tokenizer_fingerprint, self.replica.tp,
                                         "stored" if self.runner.model.mtp_layers else "skip")  # fmt: skip
                # a thread that ends with the read: a live thread that ran torch slows every step (threads.py)
                self._reading = in_own_thread(read, "glm5-weights")
            elif isinstance(msg, SwapWeights):
                self._swap(msg.version)
            elif isinstance(msg, Stats):
                channel.gather(self.runner.memory())
            elif isinstance(msg, Stop):
                return 0
            else:
                raise TypeError(f"unknown message {type(msg).__name__}")

    def _draft(self, msg: Draft) -> None:
        """The MTP pass rank 0 runs, on this rank's shard: the same rows of the same hidden states (replicated
        across the ranks), so the collectives inside match and rank 0 gets the whole vocabulary's logits."""
        if msg.step == 0:
            assert self.runner.hidden is not None, "a draft pass after a step that kept no hidden states"
            hidden = self.runner.hidden[msg.take]
        else:
            assert self._draft_out is not None
            hidden = self._draft_out[msg.keep]
        _, out = self.runner.draft(msg.plan, hidden, msg.step)
        self._draft_out = out[msg.plan.logits_rows] if msg.step == 0 else out

    def _swap(self, version: int) -> None:
        new, outcome = None, (False, "no LoadWeights before SwapWeights")
        if self._reading is not None:
            try:
                new, outcome = self._reading.result(), (True, "")
            except Exception as exc:  # the rank 0 side reports it; the replica keeps serving the old weights
                outcome = (False, str(exc))
            self._reading = None
        outcomes: list[WeightsOutcome] = self.replica.channel.gather(outcome, long=True)
        if new is not None and all(ok for ok, _ in outcomes):
            self.runner.swap_weights(new)
            log.info("rank %d: weights v%d swapped in", self.replica.tp.rank, version)


def run_follower(config: EngineConfig, local_rank: int, port: int) -> int:
    rc = resolve(config)
    rank = rank_of(config, local_rank)
    store = rendezvous(config, rank, port)
    replica = join(config, rank, rc.device_for(local_rank), store)
    runner = ModelRunner(rc, replica.tp, replica.device)
    runner.init_kv(replica.agreed_kv_bytes(runner.kv_budget))
    freeze_heap()
    return Follower(runner, replica, rc).run()


def follower_main(config: EngineConfig, local_rank: int, port: int, parent_pid: int | None, threads: int) -> None:
    """Process entry point of a follower this host started (parent_pid: exit when that process is gone)."""
    rank = rank_of(config, local_rank)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s", stream=sys.stderr
    )
    if threads > 0:
        torch.set_num_threads(threads)
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True, name="glm5-parent").start()
    try:
        code = run_follower(config, local_rank, port)
    except BaseException:
        log.exception("rank %d failed; exiting so the replica restarts", rank)
        code = 1
    # no interpreter teardown: destroying process groups with a dead peer can block
    logging.shutdown()
    os._exit(code)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    log.error("the process that started this rank is gone; exiting")
    os._exit(1)


def run_follower_host(config: EngineConfig, threads: int) -> int:
    """A host other than the first: runs this host's ranks (the first in this process), all followers. The
    exit code is non-zero if any of them failed."""
    procs = spawn_followers(config, config.master_port, first_local=1, threads=threads)
    try:
        code = run_follower(config, 0, config.master_port)
    except Exception:
        log.exception("rank %d failed; exiting so the replica restarts", rank_of(config, 0))
        code = 1
    for proc in procs:
        proc.join(timeout=STOP_WAIT_S)
        if proc.is_alive():
            proc.kill()
        code = code or (proc.exitcode or 0)
    return code


def spawn_followers(config: EngineConfig, port: int, first_local: int, threads: int) -> list[BaseProcess]:
    """Starts this host's ranks from local rank `first_local` on, one process each."""
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    for local in range(first_local, config.ranks_per_node):
        proc = ctx.Process(
            target=follower_main, args=(config, local, port, os.getpid(), threads), daemon=True,
            name=f"glm5-rank{rank_of(config, local)}",
        )  # fmt: skip
        proc.start()
        procs.append(proc)
    return procs
