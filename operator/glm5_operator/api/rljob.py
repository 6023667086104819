"""RLJob (glm5.ai/v1alpha1): asynchronous RL over GLM-5 rollout engines behind a TITO gateway.

Trust-region presets from the GLM-5 report: math (eps_low 0.15, eps_high 0.35) and terminal (0.05, 0.25);
`custom` takes explicit values. Weights sync to the rollout engines at most every 1800 s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from glm5_operator.api.base import Spec
from glm5_operator.api.deployment import ModelSource, Workers

MAX_SYNC_INTERVAL_S = 1800
TRAINER_STATUS_PORT = 8081  # `glm5 trainer --status-port`: GET /status (the operator polls it), /healthz
PRESETS: dict[str, tuple[float, float]] = {"math": (0.15, 0.35), "terminal": (0.05, 0.25)}


class RolloutPool(Spec):
    deployment_ref: str | None = Field(None, description="Reuse this GLM5Deployment's workers (same namespace).")
    workers: Workers | None = Field(None, description="Own rollout workers when there is no deploymentRef.")


class Gateway(Spec):
    replicas: int = Field(1, ge=1, description="TITO gateway replicas.")
    virtual_node_reserve: float = Field(0.2, ge=0, lt=1, description="Share of hash-ring virtual nodes held back.")
    load_bound: float = Field(1.25, ge=1, description="No rank above ceil(c * load / ranks).")
    tokenizer_fingerprint: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$", description="sha256 engines must report; refused otherwise."
    )
    port: int = Field(50060, ge=1, le=65535, description="Gateway gRPC port.")


class Trainer(Spec):
    devices: int = Field(
        1,
        ge=1,
        le=64,
        description="Accelerators for the trainer (on cpu: processes): one trainer rank each, the policy sharded "
        "over them with FSDP2 (`glm5 trainer --nproc-per-node`).",
    )
    nodes: int = Field(
        1,
        ge=1,
        le=64,
        description="Trainer pods, each running `devices` ranks (world size nodes x devices): pod 0 hosts the "
        "rendezvous on masterPort, the others find it by its stable name. Over 1 the pods share one ReadWriteMany "
        "checkpoint claim (checkpointStorageClass) instead of a claim of their own, so a job keeps 1 or more than "
        "1 for its life.",
    )
    master_port: int = Field(29500, ge=1024, le=65535, description="Trainer pod 0's rendezvous port (nodes > 1).")
    checkpoint_storage_class: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="Storage class of the shared ReadWriteMany checkpoint claim when nodes > 1 (default: the "
        "cluster's default class, which must offer ReadWriteMany: NFS, CephFS, a cloud file store).",
    )
    checkpoint_size: str = Field(
        "100Gi", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$", description="Checkpoint claim size."
    )
    accelerator: Literal["ascend-910b", "nvidia", "cpu"] = Field("cpu", description="Trainer device type.")
    learning_rate: float = Field(1e-6, gt=0, description="Optimizer learning rate.")
    task_preset: Literal["math", "terminal", "custom"] = Field("math", description="Trust-region preset.")
    eps_low: float | None = Field(None, gt=0, lt=1, description="Lower IS ratio bound (overrides the preset).")
    eps_high: float | None = Field(None, gt=0, description="Upper IS ratio bound (overrides the preset).")
    staleness_limit: int = Field(4, ge=0, description="Drop samples more than this many versions old.")
    sync_interval_seconds: int = Field(600, ge=1, le=MAX_SYNC_INTERVAL_S, description="Max seconds between syncs.")
    sync_every_steps: int = Field(8, ge=1, description="Publish actor_synced every K steps.")
    ema_decay: float = Field(0.999, gt=0, lt=1, description="Decay of actor_ema.")
    steps: int = Field(
        0,
        ge=0,
        description=(
            "Optimizer steps for the whole job (0: train until the RLJob is deleted). When the trainer has taken "
            "them, the job's condition Succeeded turns True and its trainer, gateway and own rollout workers scale "
            "to zero; the checkpoint volume stays. Raising it resumes the job from its last published version."
        ),
    )
    weight_transport: Literal["collective", "stream"] = Field(
        "collective",
        description=(
            "How each published version reaches the rollout workers. collective: every trainer rank sends the "
            "rows of its shard straight to every rank of every replica over a gloo group (no file; all ports "
            "open between the trainer pod and the workers, which the rendered NetworkPolicy admits). stream: the "
            "published files over the workers' gRPC port (PushWeights), when only that port is reachable."
        ),
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each layer's activations in the backward pass (less memory, longer steps)."
    )
    sync_port: int = Field(29600, ge=1024, le=65535, description="The collective's rendezvous port on the trainer.")
    image: str | None = Field(None, description="Trainer image (default: the operator's configured image).")
    group_size: int = Field(8, ge=2, description="Rollouts per problem (advantages are normalised in a group).")
    groups_per_step: int = Field(8, ge=1, description="Problem groups per optimizer step.")
    max_new_tokens: int = Field(40, ge=1, description="Token limit of one rollout's answer.")
    eval_size: int = Field(200, ge=0, description="Held-out problems scored greedily before and after (0: none).")

    def trust_region(self) -> tuple[float, float]:
        low, high = PRESETS.get(self.task_preset, (None, None))
        low = self.eps_low if self.eps_low is not None else low
        high = self.eps_high if self.eps_high is not None else high
        assert low is not None and high is not None, "validated by rljob_problems"
        return low, high


class Dataset(Spec):
    uri: str = Field(
        min_length=1,
        description="Problems: 'builtin' (the environment's own), or a JSONL file: on pvcName's claim (under "
        "mountPath) or in the trainer image.",
    )
    environment: str = Field("addition", description="Reward environment name.")
    pvc_name: str | None = Field(None, description="PersistentVolumeClaim holding the dataset, mounted read-only.")
    mount_path: str = Field("/data", pattern=r"^/", description="Where pvcName's claim is mounted in the trainer.")


class RLJobSpec(Spec):
    policy: ModelSource
    rollout: RolloutPool = Field(default_factory=RolloutPool)
    gateway: Gateway = Field(default_factory=Gateway)
    trainer: Trainer = Field(default_factory=Trainer)
    dataset: Dataset
