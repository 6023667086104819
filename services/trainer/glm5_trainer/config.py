"""An RL run's settings (`RLConfig`, what `glm5 trainer` / `glm5 rl` / an RLJob pass) and its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5.security import NO_TLS, Secret, TlsConfig

from glm5_trainer.loss import TrustRegion
from glm5_trainer.sync import DEFAULT_BUCKET_BYTES
from glm5_trainer.versions import TRANSPORTS

MODES = ("async", "sync")


@dataclass(frozen=True, slots=True)
class RLConfig:
    policy: Path  # the starting checkpoint (its tokenizer is the job's)
    gateway: str  # host:port of the TITO gateway
    out: Path  # versioned checkpoints, history, plot
    engines: tuple[str, ...] = ()  # rollout engines to sync and evaluate on (host:port)
    engine_dns: str | None = None  # or a headless Service (host:port): every A record is an engine
    environment: str = "addition"
    dataset: str = "builtin"
    mode: str = "async"
    steps: int = 40
    group_size: int = 8
    groups_per_step: int = 8
    max_inflight_groups: int = 16
    producer_cpus: tuple[int, ...] = ()  # async: pin the rollout producer process to these CPUs
    max_new_tokens: int = 40
    temperature: float = 1.0
    learning_rate: float = 1e-4
    lr_schedule: str = "constant"  # or "cosine": decays to 0 over `steps` (a run of known length)
    region: TrustRegion = field(default_factory=lambda: TrustRegion.preset("math"))
    staleness_limit: int = 4
    balance_weight: float = 0.02  # MoE expert-balance loss
    entropy_weight: float = 0.005  # router-entropy regulariser
    sync_every_steps: int = 1
    sync_interval_s: float = 600.0
    ema_decay: float = 0.999
    eval_every: int = 0  # steps between evaluations (0: before and after only)
    eval_size: int = 200
    seed: int = 0  # problem order and rollout sampling
    split_seed: int = 0  # the built-in dataset's train/held-out split: the supervised stage's seed, so the
    # held-out problems stay unseen by both stages
    redis_url: str | None = None  # read the buffer's Redis stream directly (default: through the gateway)
    job: str = "rl"
    progress: bool = True
    completion_file: Path | None = None  # written when the job has taken its `steps`
    tls: TlsConfig = NO_TLS  # to the gateway and the engines (mutual TLS when it has a CA)
    admin_token: Secret | None = None  # sent with UpdateWeights (the engines' --admin-token-*)
    internal_token: Secret | None = None  # sent with every call to the engines (their --internal-token-*)
    weights_transport: str = "path"  # versions.TRANSPORTS: the engines read out/ (shared), get it streamed, or
    # receive it over a collective group from the trainer's memory
    sync_address: str = "127.0.0.1"  # collective: where the engines reach rank 0's rendezvous (its pod IP)
    sync_port: int = 0  # 0: any free port
    sync_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    sync_timeout_s: float = 120.0  # a group's join and each bucket's broadcast
    activation_checkpointing: bool = False  # recompute each layer's activations in the backward pass
    expert_parallel: bool = True  # several ranks: each holds whole routed experts, the tokens travel to them

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
