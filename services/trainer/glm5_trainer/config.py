"""An RL run's settings (`RLConfig`, what `glm5 trainer` / `glm5 rl` / an RLJob pass) and its result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5.security import NO_TLS, Secret, TlsConfig
from glm5.settings import derived, setting

from glm5_trainer.loss import TrustRegion
from glm5_trainer.sync import DEFAULT_BUCKET_BYTES
from glm5_trainer.versions import TRANSPORTS

MODES = ("async", "sync")


PUSHES = "weight pushes (docs/security.md)"
RANKS = ("ranks: torchrun's flags (or run under torchrun / a PyTorchJob, which set RANK, WORLD_SIZE, LOCAL_RANK, "
         "MASTER_ADDR, MASTER_PORT)")  # fmt: skip


@dataclass(frozen=True, slots=True)
class RLConfig:
    """Every setting of an RL run; each field's flag (`glm5 trainer --help`) is declared with it
    (glm5.settings). policy, gateway and out are required: glm5_trainer.cli checks them (they may come from
    --config)."""

    policy: Path = setting(help="starting checkpoint (HuggingFace folder with its tokenizer; the job's tokenizer); "
                           "required")  # fmt: skip
    gateway: str = setting(help="host:port of the TITO gateway; required")
    out: Path = setting(name="checkpoint-dir", given="rl-out", help="versioned checkpoints, history, plot")
    engines: tuple[str, ...] = setting((), name="engine", repeat=True, help="rollout engine host:port to sync and "
                                       "evaluate on (repeatable)")  # fmt: skip
    engine_dns: str | None = setting(None, name="engines", help="host:port of the engines' headless Service (every "
                                     "A record is an engine)")  # fmt: skip
    environment: str = setting("addition", help="reward environment (addition, tools)")
    dataset: str = setting("builtin", help="'builtin' or a JSONL file of problems")
    mode: str = setting("async", choices=MODES, help="async: rollouts go on while the trainer trains; sync: "
                        "generate, train, push")  # fmt: skip
    steps: int = setting(40, help="optimizer steps for the job, counting those a restarted trainer resumes after "
                         "(0: until SIGTERM/SIGINT)")  # fmt: skip
    group_size: int = setting(8, help="rollouts per problem (GRPO group)")
    groups_per_step: int = setting(8, help="GRPO groups per optimizer step")
    max_inflight_groups: int = setting(16, help="async: groups generating")
    producer_cpus: tuple[int, ...] = derived((), why="async: the CPUs the rollout producer process is pinned to "
                                             "(benchmarks/rl_loop.py sets it; no flag)")  # fmt: skip
    max_new_tokens: int = setting(40, help="tokens per rollout turn")
    temperature: float = setting(1.0, help="rollout sampling temperature")
    learning_rate: float = setting(1e-4, help="AdamW learning rate")
    lr_schedule: str = setting("constant", choices=("constant", "cosine"), help="cosine: decay to 0 over --steps (a "
                               "run of known length)")  # fmt: skip
    region: TrustRegion = derived(default_factory=lambda: TrustRegion.preset("math"),
                                  why="--task-preset, --eps-low and --eps-high (glm5_trainer.cli)")  # fmt: skip
    staleness_limit: int = setting(4, help="drop samples this many versions old")
    balance_weight: float = setting(0.02, help="MoE expert-balance loss weight")
    entropy_weight: float = setting(0.005, help="router-entropy regulariser weight")
    sync_every_steps: int = setting(1, help="publish actor_synced every K steps")
    sync_interval_s: float = setting(600.0, name="sync-interval-seconds", help="... and at least this often")
    ema_decay: float = setting(0.999, help="decay of actor_ema (moving average)")
    eval_every: int = setting(0, help="steps between held-out evaluations (0: before and after only)")
    eval_size: int = setting(200, help="held-out problems per evaluation")
    seed: int = setting(0, help="problem order and rollout sampling")
    # the held-out problems stay unseen by both stages
    split_seed: int = setting(0, help="train/held-out split of --dataset builtin: the supervised stage's seed")
    redis_url: str | None = setting(None, repr=False, help="read rollouts from the Redis stream (default: through "
                                    "the gateway)")  # fmt: skip
    job: str = setting("rl", help="prefix of rollout ids")
    progress: bool = setting(True, help="progress bars (training, evaluations)")
    completion_file: Path | None = setting(None, help="when the job has taken its --steps, write {complete, steps, "
                                           "version} here as JSON (an RLJob pod: its termination log, which the "
                                           "operator reads)")  # fmt: skip
    tls: TlsConfig = derived(NO_TLS, why="--tls-* (glm5.security): to the gateway and the engines (mutual TLS when "
                             "it has a CA)")  # fmt: skip
    admin_token: Secret | None = derived(None, why="--admin-token-file / -env: sent with UpdateWeights (the "
                                         "engines' --admin-token-*)")  # fmt: skip
    internal_token: Secret | None = derived(None, why="--internal-token-file / -env: sent with every call to the "
                                            "engines (their --internal-token-*)")  # fmt: skip
    weights_transport: str = setting("path", choices=TRANSPORTS, group=PUSHES,
                                     help="path: the engines read each version from --checkpoint-dir (a volume they "
                                     "share); stream: its files are sent to them over gRPC (PushWeights); "
                                     "collective: the trainer's weights are broadcast in buckets over a gloo group "
                                     "per engine replica (SyncWeights), no file read")  # fmt: skip
    sync_address: str = setting("127.0.0.1", group=PUSHES, help="collective: the address the engines reach this "
                                "trainer's rendezvous at (its pod IP)")  # fmt: skip
    sync_port: int = setting(0, group=PUSHES, help="collective: the rendezvous port (0: any)")
    sync_bucket_bytes: int = setting(DEFAULT_BUCKET_BYTES, group=PUSHES, help="collective: bytes broadcast at a "
                                     "time (what each engine rank holds beyond its shard)")  # fmt: skip
    sync_timeout_s: float = setting(120.0, name="sync-timeout", group=PUSHES, help="collective: seconds the engines "
                                    "may take to join, and each bucket to arrive")  # fmt: skip
    activation_checkpointing: bool = setting(False, group=RANKS, help="recompute each decoder layer's activations "
                                             "in the backward pass instead of keeping them (less memory for a "
                                             "longer step)")  # fmt: skip
    expert_parallel: bool = setting(True, group=RANKS, help="with several ranks, each holds whole routed experts "
                                    "and the tokens travel to them (--no-expert-parallel: FSDP2 gathers every "
                                    "routed expert of a layer onto every rank)")  # fmt: skip

    def __post_init__(self) -> None:
        problems = []
        if self.lr_schedule not in ("constant", "cosine"):
            problems.append("lr_schedule must be constant or cosine")
        if self.mode not in MODES:
            problems.append(f"mode must be one of {MODES}")
        if self.weights_transport not in TRANSPORTS:
            problems.append(f"weights_transport must be one of {TRANSPORTS}")
        if self.sync_bucket_bytes < 1 << 20 or self.sync_timeout_s <= 0 or not 0 <= self.sync_port < 65536:
            problems.append("sync_bucket_bytes >= 1 MiB, sync_timeout_s > 0, sync_port a port (0: any)")
        if not self.engines and not self.engine_dns:
            problems.append("rollout engines are needed (engines or engine_dns) to sync weights and evaluate")
        for name in ("group_size", "groups_per_step", "max_inflight_groups", "max_new_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.steps < 0:
            problems.append("steps must be >= 0 (0: train until stopped)")
        if self.steps == 0 and self.lr_schedule == "cosine":
            problems.append("the cosine schedule needs a number of steps")
        if self.group_size < 2:
            problems.append("group_size must be >= 2 (group-normalised advantages)")
        if self.temperature <= 0:
            problems.append("temperature must be > 0 (rollouts sample)")
        if self.learning_rate <= 0 or self.staleness_limit < 0 or self.eval_every < 0 or self.eval_size < 0:
            problems.append("learning_rate > 0, staleness_limit >= 0, eval_every >= 0, eval_size >= 0")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class Result:
    accuracy_before: float | None
    accuracy_after: float | None
    train_seconds: float  # the loop only (evaluations before and after excluded)
    trained_samples: int
    final_version: int
    final_checkpoint: str
    counters: dict[str, int]
    sync_seconds: list[float]
    history: list[dict[str, Any]]
    evaluation_before: dict[str, Any] | None = None  # accuracy and tool calls (environment.evaluation_summary)
    evaluation_after: dict[str, Any] | None = None
    trainer: dict[str, Any] | None = None  # world size and each rank's state bytes
