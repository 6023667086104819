"""`glm5 trainer`: flags (or the RLJob's trainer.json through --config) -> RLConfig -> the RL loop."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from glm5.errors import ConfigError
from glm5.security import (
    add_internal_token_arguments,
    add_tls_arguments,
    admin_token_from_args,
    internal_token_from_args,
    tls_from_args,
)
from glm5.settings import add_flags, from_flags, group

from glm5_trainer.config import PUSHES, RANKS, Result, RLConfig
from glm5_trainer.distributed import World, leave
from glm5_trainer.loop import RLRun
from glm5_trainer.loss import PRESETS, TrustRegion
from glm5_trainer.resume import finished, open_trainer, report_finished
from glm5_trainer.status import serve_health, serve_status


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, RLConfig)  # the run's settings; what follows is this process's and the derived ones
    p.add_argument("--task-preset", default="math", choices=[*PRESETS, "custom"], help="trust-region preset")
    p.add_argument("--eps-low", type=float, help="lower IS-ratio bound (overrides the preset)")
    p.add_argument("--eps-high", type=float, help="upper IS-ratio bound (overrides the preset)")
    p.add_argument("--verbose", action="store_true", help="debug logging (a line per step)")
    p.add_argument("--status-port", type=int, default=0,
                   help="serve GET /status (progress as JSON) and /healthz on this port (0: off)")  # fmt: skip
    p.add_argument("--status-host", default="127.0.0.1", help="address of the status endpoint")
    add_tls_arguments(p)
    add_internal_token_arguments(p)
    g = group(p, PUSHES)
    g.add_argument("--admin-token-file", help="file holding the engines' admin token, sent with UpdateWeights")
    g.add_argument("--admin-token-env", help="environment variable holding that token")
    r = group(p, RANKS)
    r.add_argument("--nproc-per-node", type=int, default=1, help="trainer ranks on this host (the policy is "
                   "sharded over all ranks with FSDP2; rank 0 alone runs the loop)")  # fmt: skip
    r.add_argument("--nnodes", type=int, default=1, help="hosts taking part")
    r.add_argument("--node-rank", type=int, default=0, help="this host's index (0 hosts the rendezvous)")
    r.add_argument("--master-addr", default="127.0.0.1", help="address of host 0 (the rendezvous)")
    r.add_argument("--master-port", type=int, default=29500, help="its rendezvous port")


def config_from_args(a: argparse.Namespace) -> RLConfig:
    if not a.policy or not a.gateway:
        raise ConfigError("the trainer needs --policy (a checkpoint folder) and --gateway (host:port)")
    if not (a.policy / "config.json").is_file():
        raise ConfigError(f"--policy {a.policy}: no config.json (a HuggingFace checkpoint folder is expected)")
    try:
        return from_flags(RLConfig, a, region=TrustRegion.preset(a.task_preset, a.eps_low, a.eps_high),
                          tls=tls_from_args(a), admin_token=admin_token_from_args(a),
                          internal_token=internal_token_from_args(a))  # fmt: skip
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def report(r: Result) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    syncs = sorted(r.sync_seconds)
    median = syncs[len(syncs) // 2] if syncs else 0.0
    counters = json.dumps(r.counters, sort_keys=True)
    return (f"held-out accuracy {pct(r.accuracy_before)} -> {pct(r.accuracy_after)}; {r.trained_samples} samples in "
            f"{r.train_seconds:.0f}s; {len(syncs)} weight syncs (median {median * 1000:.0f} ms); final version "
            f"{r.final_version} at {r.final_checkpoint}; counters {counters}")  # fmt: skip


def launch(a: argparse.Namespace) -> int:
    """Starts this host's ranks as torchrun does (torch's elastic launcher, static rendezvous at
    --master-addr:--master-port), each one this same command with torchrun's variables set; when a rank
    fails the launcher stops the others. Returns the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=a.nnodes, max_nodes=a.nnodes, nproc_per_node=a.nproc_per_node, run_id="glm5-trainer",
        rdzv_backend="static", rdzv_endpoint=f"{a.master_addr}:{a.master_port}",
        rdzv_configs={"rank": a.node_rank, "timeout": 900}, max_restarts=0, monitor_interval=0.5,
        shutdown_timeout=600,  # SIGTERM: rank 0 finishes its step, publishes and pushes before the ranks exit
    )  # fmt: skip
    try:
        elastic_launch(config, sys.executable)("-m", "glm5_cli", *sys.argv[1:])
    except ChildFailedError as exc:
        logging.getLogger(__name__).error("a trainer rank failed: %s", exc.failures)
        return 1
    return 0


def world_from_args(a: argparse.Namespace) -> World | None:
    """The world this process is a rank of, or None when it must start the ranks itself (launch)."""
    if a.nproc_per_node < 1 or a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        raise ConfigError("--nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes")
    wanted = a.nproc_per_node * a.nnodes
    if "WORLD_SIZE" not in os.environ:
        return World() if wanted == 1 else None
    world = World.from_env()
    if wanted > 1 and world.size != wanted:
        raise ConfigError(f"WORLD_SIZE is {world.size} but the flags ask for {a.nnodes} x {a.nproc_per_node} ranks")
    return world


def run(a: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    config = config_from_args(a)
    world = world_from_args(a)
    done = finished(config) if world is None or world.size == 1 else None
    if done is not None:
        # restarted after the job finished: every host exits at once, no rank started, no rendezvous to meet
        logging.getLogger(__name__).info("the job already took its %d steps (version %d): nothing to train",
                                         done[1], done[0])  # fmt: skip
        report_finished(config, *done)
        return
    if world is None:
        sys.exit(launch(a))
    if not world.leader:
        # rank 0 decides when to stop (it finishes the step and publishes): a signal here would break that
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        trainer = open_trainer(config, world)
        if a.status_port and world.local_rank == 0:  # the first rank of another host: its pod's readiness
            serve_health(a.status_host, a.status_port)
        trainer.ranks.follow()
        leave()

    async def main() -> Result:
        run = RLRun(config, world)
        for sig in (signal.SIGTERM, signal.SIGINT):  # a deleted pod or Ctrl-C: finish the step, publish, stop
            asyncio.get_running_loop().add_signal_handler(sig, run.request_stop)
        status = await serve_status(a.status_host, a.status_port, run.progress) if a.status_port else None
        try:
            return await run.run()
        finally:
            if status is not None:
                await status.cleanup()

    result = asyncio.run(main())
    print(report(result), flush=True)
    leave()
