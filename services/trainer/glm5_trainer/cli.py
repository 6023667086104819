"""`glm5 trainer`: flags (or the RLJob's trainer.json through --config) -> RLConfig -> the RL loop."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from glm5.errors import ConfigError
from glm5.security import (
    add_internal_token_arguments,
    add_tls_arguments,
    admin_token_from_args,
    internal_token_from_args,
    tls_from_args,
)

from glm5_trainer.config import MODES, Result, RLConfig
from glm5_trainer.distributed import World, leave
from glm5_trainer.loop import RLRun
from glm5_trainer.loss import PRESETS, TrustRegion
from glm5_trainer.resume import finished, open_trainer, report_finished
from glm5_trainer.status import serve_health, serve_status
from glm5_trainer.versions import TRANSPORTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RLConfig(policy=Path("."), gateway="", out=Path("."), engines=("x",))
    # required, but checked in config_from_args: they may come from --config
    p.add_argument("--policy", help="starting checkpoint (HuggingFace folder with its tokenizer); required")
    p.add_argument("--gateway", help="host:port of the TITO gateway; required")
    p.add_argument("--engine", action="append", default=[], help="rollout engine host:port to sync (repeatable)")
    p.add_argument("--engines", help="host:port of the engines' headless Service (every A record is an engine)")
    p.add_argument("--checkpoint-dir", default="rl-out", help="versioned checkpoints, history, plot")
    p.add_argument("--environment", default=d.environment, help="reward environment (addition, tools)")
    p.add_argument("--dataset", default=d.dataset, help="'builtin' or a JSONL file of problems")
    p.add_argument("--mode", default=d.mode, choices=MODES,
                   help="async: rollouts go on while the trainer trains; sync: generate, train, push")  # fmt: skip
    p.add_argument("--steps", type=int, default=d.steps,
                   help="optimizer steps for the job, counting those a restarted trainer resumes after "
                   "(0: until SIGTERM/SIGINT)")  # fmt: skip
    p.add_argument("--completion-file",
                   help="when the job has taken its --steps, write {complete, steps, version} here as JSON (an "
                   "RLJob pod: its termination log, which the operator reads)")  # fmt: skip
    p.add_argument("--group-size", type=int, default=d.group_size, help="rollouts per problem (GRPO group)")
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step, help="GRPO groups per optimizer step")
    p.add_argument("--max-inflight-groups", type=int, default=d.max_inflight_groups, help="async: groups generating")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens per rollout turn")
    p.add_argument("--temperature", type=float, default=d.temperature, help="rollout sampling temperature")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate, help="AdamW learning rate")
    p.add_argument("--lr-schedule", default=d.lr_schedule, choices=["constant", "cosine"],
                   help="cosine: decay to 0 over --steps (a run of known length)")  # fmt: skip
    p.add_argument("--task-preset", default="math", choices=[*PRESETS, "custom"], help="trust-region preset")
    p.add_argument("--eps-low", type=float, help="lower IS-ratio bound (overrides the preset)")
    p.add_argument("--eps-high", type=float, help="upper IS-ratio bound (overrides the preset)")
    p.add_argument("--staleness-limit", type=int, default=d.staleness_limit, help="drop samples this many versions old")
    p.add_argument("--balance-weight", type=float, default=d.balance_weight, help="MoE expert-balance loss weight")
    p.add_argument("--entropy-weight", type=float, default=d.entropy_weight, help="router-entropy regulariser weight")
    p.add_argument("--sync-every-steps", type=int, default=d.sync_every_steps, help="publish actor_synced every K")
    p.add_argument("--sync-interval-seconds", type=float, default=d.sync_interval_s, help="and at least this often")
    p.add_argument("--ema-decay", type=float, default=d.ema_decay, help="decay of actor_ema (moving average)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between held-out evaluations")
    p.add_argument("--eval-size", type=int, default=d.eval_size, help="held-out problems per evaluation")
    p.add_argument("--seed", type=int, default=d.seed, help="problem order and rollout sampling")
    p.add_argument("--split-seed", type=int, default=d.split_seed,
                   help="train/held-out split of --dataset builtin: the supervised stage's seed")  # fmt: skip
    p.add_argument("--redis-url", help="read rollouts from the Redis stream (default: through the gateway)")
    p.add_argument("--job", default=d.job, help="prefix of rollout ids")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (training, evaluations)")
    p.add_argument("--verbose", action="store_true", help="debug logging (a line per step)")
    p.add_argument("--status-port", type=int, default=0,
                   help="serve GET /status (progress as JSON) and /healthz on this port (0: off)")  # fmt: skip
    p.add_argument("--status-host", default="127.0.0.1", help="address of the status endpoint")
    add_tls_arguments(p)
    add_internal_token_arguments(p)
    g = p.add_argument_group("weight pushes (docs/security.md)")
    g.add_argument("--admin-token-file", help="file holding the engines' admin token, sent with UpdateWeights")
    g.add_argument("--admin-token-env", help="environment variable holding that token")
    g.add_argument("--weights-transport", choices=TRANSPORTS, default=d.weights_transport,
                   help="path: the engines read each version from --checkpoint-dir (a volume they share); stream: "
                   "its files are sent to them over gRPC (PushWeights); collective: the trainer's weights are "
                   "broadcast in buckets over a gloo group per engine replica (SyncWeights), no file read")  # fmt: skip
    g.add_argument(
        "--sync-address",
        default=d.sync_address,
        help="collective: the address the engines reach this trainer's rendezvous at (its pod IP)",
    )
    g.add_argument("--sync-port", type=int, default=d.sync_port, help="collective: the rendezvous port (0: any)")
    g.add_argument(
        "--sync-bucket-bytes",
        type=int,
        default=d.sync_bucket_bytes,
        help="collective: bytes broadcast at a time (what each engine rank holds beyond its shard)",
    )
    g.add_argument(
        "--sync-timeout",
        type=float,
        default=d.sync_timeout_s,
        help="collective: seconds the engines may take to join, and each bucket to arrive",
    )
    r = p.add_argument_group("ranks: torchrun's flags (or run under torchrun / a PyTorchJob, which set RANK, "
                             "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")  # fmt: skip
    r.add_argument("--nproc-per-node", type=int, default=1, help="trainer ranks on this host (the policy is "
                   "sharded over all ranks with FSDP2; rank 0 alone runs the loop)")  # fmt: skip
    r.add_argument("--nnodes", type=int, default=1, help="hosts taking part")
    r.add_argument("--node-rank", type=int, default=0, help="this host's index (0 hosts the rendezvous)")
    r.add_argument("--master-addr", default="127.0.0.1", help="address of host 0 (the rendezvous)")
    r.add_argument("--master-port", type=int, default=29500, help="its rendezvous port")
    r.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer's activations in the backward pass instead of keeping them "
                   "(less memory for a longer step)")  # fmt: skip
    r.add_argument("--no-expert-parallel", dest="expert_parallel", action="store_false",
                   help="with several ranks, let FSDP2 gather every routed expert of a layer onto every rank "
                   "instead of splitting the experts over the ranks and sending the tokens to them")  # fmt: skip


def config_from_args(a: argparse.Namespace) -> RLConfig:
    if not a.policy or not a.gateway:
        raise ConfigError("the trainer needs --policy (a checkpoint folder) and --gateway (host:port)")
    policy = Path(a.policy)
    if not (policy / "config.json").is_file():
        raise ConfigError(f"--policy {policy}: no config.json (a HuggingFace checkpoint folder is expected)")
    try:
        region = TrustRegion.preset(a.task_preset, a.eps_low, a.eps_high)
        return RLConfig(
            policy=policy, gateway=a.gateway, out=Path(a.checkpoint_dir), engines=tuple(a.engine),
            engine_dns=a.engines, environment=a.environment, dataset=a.dataset, mode=a.mode, steps=a.steps,
            group_size=a.group_size, groups_per_step=a.groups_per_step, max_inflight_groups=a.max_inflight_groups,
            max_new_tokens=a.max_new_tokens, temperature=a.temperature, learning_rate=a.learning_rate,
            lr_schedule=a.lr_schedule,
            region=region, staleness_limit=a.staleness_limit, balance_weight=a.balance_weight,
            entropy_weight=a.entropy_weight, sync_every_steps=a.sync_every_steps,
            sync_interval_s=a.sync_interval_seconds, ema_decay=a.ema_decay, eval_every=a.eval_every,
            eval_size=a.eval_size, seed=a.seed, split_seed=a.split_seed, redis_url=a.redis_url, job=a.job,
            progress=not a.no_progress,
            completion_file=Path(a.completion_file) if a.completion_file else None, tls=tls_from_args(a),
            admin_token=admin_token_from_args(a), weights_transport=a.weights_transport,
            sync_address=a.sync_address, sync_port=a.sync_port, sync_bucket_bytes=a.sync_bucket_bytes,
            sync_timeout_s=a.sync_timeout, activation_checkpointing=a.activation_checkpointing,
            expert_parallel=a.expert_parallel,
            internal_token=internal_token_from_args(a),
        )  # fmt: skip
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
