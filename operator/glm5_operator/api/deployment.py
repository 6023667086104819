"""GLM5Deployment (glm5.ai/v1alpha1): one served model, its workers, router and configuration.

Defaults are the engine's and the source material's (see docs/worker.md): 131072-token context, dense
warm-up 128 tokens, INT8 KV tier with a 128-token L1 window, 8192-token batching budget, breaker thresholds
0.65 / 0.12 / 150 ms / 30 s with 5% half-open probes, long queue paused above 85% KV usage, Ascend
temperature floor 0.35.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from glm5_operator.api.base import Spec

Accelerator = Literal["ascend-910b", "nvidia", "cpu"]


class RopeScaling(Spec):
    type: Literal["linear", "yarn"] = Field(description="RoPE scaling method.")
    factor: float = Field(gt=1, description="Scaling factor; must be a power of two (2, 4, 8, ...).")
    original_max_position_embeddings: int | None = Field(
        None, ge=1, description="Context the checkpoint was trained with (YaRN); default: the checkpoint's."
    )


class ModelSource(Spec):
    path: str = Field(min_length=1, description="Checkpoint directory inside the worker container.")
    pvc_name: str | None = Field(None, description="PersistentVolumeClaim holding the checkpoint, mounted at path.")
    host_path: str | None = Field(None, description="Host directory holding the checkpoint, mounted at path.")
    served_name: str | None = Field(None, description="Model name clients use (default: the resource name).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Weight and compute dtype.")
    quantization: Literal["auto", "none", "fp8", "compressed-tensors"] = Field(
        "auto",
        description="Weight format the checkpoint must have (workers fail at start-up on another): fp8 = block FP8 "
        "(GLM-5-FP8), compressed-tensors = INT4 / INT4 + FP8, none = float; auto reads the checkpoint.",
    )
    max_model_len: int = Field(131072, ge=1, description="Context limit in tokens (prompt + generated).")
    max_new_tokens: int = Field(256, ge=1, description="Default max_new_tokens for requests that give none.")
    rope_scaling: RopeScaling | None = Field(None, description="Override the checkpoint's RoPE scaling.")


class SparseAttention(Spec):
    dense_warmup_tokens: int = Field(128, ge=0, description="Early tokens attend densely; 0 disables it.")
    dynamic_sparsity: bool = Field(False, description="Widen a layer's top-k while its attention entropy is low.")
    kernels: Literal["auto", "portable", "triton"] = Field(
        "auto",
        description="DSA kernel backend: auto = fused Triton kernels on NVIDIA GPUs (self-checked at start-up, "
        "portable PyTorch if they fail), portable PyTorch elsewhere.",
    )


class KVCache(Spec):
    bytes: str = Field(
        "auto",
        pattern=r"^(auto|[0-9]+(\.[0-9]+)?([KMG]i?B?|[kmg]b?)?)$",
        description="KV pool size: 'auto' or a size such as 40GiB.",
    )
    int8_tier: bool = Field(True, description="Store tokens older than l1Tokens as INT8 with per-token scales.")
    l1_tokens: int = Field(128, ge=0, description="Most recent tokens kept at model precision.")
    block_size: int = Field(64, ge=1, le=4096, description="Tokens per KV block.")
    prefix_caching: bool = Field(True, description="Reuse cached blocks of repeated prompt prefixes.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="L1 latents' and rope keys' dtype (auto: the model's); bfloat16 in a float32 model halves them "
        "(read back into float32 for attention).",
    )
    index_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="L1 indexer keys' dtype (auto: kvCache.dtype); bfloat16 in a float32 model halves them and speeds "
        "up long-context top-k selection, changing picks only among near-ties.",
    )


class Workers(Spec):
    replicas: int = Field(1, ge=0, description="Model replicas; the scale subresource.")
    devices_per_replica: int = Field(
        1,
        ge=1,
        description="Devices one model replica spans (glm5 worker --tensor-parallel-size; one HCCL ring). On cpu: "
        "ranks, one process each.",
    )
    devices_per_node: int | None = Field(
        None,
        ge=1,
        description="Devices one worker pod (one node) holds; a replica with more spans devicesPerReplica / "
        "devicesPerNode pods. Default: the whole replica in one pod.",
    )
    expert_parallel: bool = Field(
        True, description="Partition the routed experts over a replica's devices (else split every expert)."
    )
    collective_timeout_seconds: int = Field(
        120,
        ge=1,
        description="A collective between a replica's devices that takes longer fails the replica (it restarts); "
        "also HCCL_EXEC_TIMEOUT on Ascend.",
    )
    multi_node: Literal["auto", "leaderWorkerSet", "statefulSets"] = Field(
        "auto",
        description="How a replica over several pods is run: leaderWorkerSet = one group of a LeaderWorkerSet per "
        "replica (the LWS controller restarts a group as a whole); statefulSets = one StatefulSet per node of a "
        "replica; auto = leaderWorkerSet where the cluster serves it when the deployment is created. Fixed once "
        "the workers exist (status.workerSet).",
    )
    rendezvous_port: int = Field(
        29500, ge=1, le=65535, description="Port the first pod of a multi-pod replica listens on for the others."
    )
    accelerator: Accelerator = Field("cpu", description="Device type the workers request.")
    image: str | None = Field(None, description="Worker image (default: the operator's configured image).")
    resources: dict[str, Any] | None = Field(None, description="Extra container resources (requests/limits).")
    ring_order: list[int] | None = Field(
        None,
        description="Manual HCCL ring: ringOrder[i] is the device (in device_id order over the replica's pods) that "
        "gets rank i; also sets HCCL_ALGO to the ring algorithm between servers. Default: 0..N-1, HCCL's own choice.",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node selector for worker pods.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Tolerations for worker pods.")
    port: int = Field(50051, ge=1, le=65535, description="Worker gRPC port.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences a worker runs at once.")

    @property
    def node_devices(self) -> int:
        return self.devices_per_node or self.devices_per_replica

    @property
    def pods_per_replica(self) -> int:
        return max(1, self.devices_per_replica // self.node_devices)


class Batching(Spec):
    token_budget: int = Field(8192, ge=1, description="Flush a batch when its max_new_tokens sum reaches this.")
    max_wait_ms: float = Field(5.0, ge=0, description="Or when its oldest request waited this long.")


class Queues(Spec):
    short_max_prompt_tokens: int = Field(2048, ge=1, description="Prompts below this go to the short queue.")
    long_min_prompt_tokens: int = Field(32768, ge=1, description="Prompts from this length go to the long queue.")
    long_pause_kv_usage: float = Field(0.85, gt=0, le=1, description="Pause the long queue above this KV usage.")
    max_queued: int = Field(10000, ge=1, description="Queued requests before 429 / RESOURCE_EXHAUSTED.")


class SecretKeyRef(Spec):
    name: str = Field(min_length=1, description="Secret name.")
    key: str = Field(min_length=1, description="Key in the Secret.")


class Redis(Spec):
    url: str | None = Field(None, description="redis:// URL of a shared queue (several router replicas).")
    url_secret: SecretKeyRef | None = Field(None, description="Secret key holding the URL.")


class CircuitBreaker(Spec):
    kv_fragmentation: float = Field(0.65, ge=0, le=1, description="Open when KV fragmentation stays above.")
    entropy_drift: float = Field(0.12, ge=0, description="Open when attention-entropy drift stays above.")
    token_jitter_ms: float = Field(150.0, ge=0, description="Open when per-token latency jitter stays above.")
    spec_window_tokens: int = Field(256, ge=1, description="Draft tokens per speculative-acceptance window.")
    spec_acceptance_drop: float = Field(0.5, ge=0, lt=1, description="Degrade a worker whose window's acceptance "
                                        "falls below this times its own baseline (0: off).")  # fmt: skip
    spec_acceptance_max: float = Field(0.96, gt=0, le=1, description="Degrade a worker whose window's acceptance "
                                       "is above this (implausible: Z.ai's garbled-output signal).")  # fmt: skip
    sustained_seconds: float = Field(30.0, ge=0, description="How long a signal must stay over its threshold.")
    half_open_share: float = Field(0.05, gt=0, le=1, description="Share of traffic admitted as probes.")


class Router(Spec):
    replicas: int = Field(1, ge=0, description="Router replicas.")
    image: str | None = Field(None, description="Router image (default: the operator's configured image).")
    grpc_port: int = Field(50050, ge=1, le=65535, description="Router gRPC port.")
    http_port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible HTTP port.")
    batching: Batching = Field(default_factory=Batching)
    queues: Queues = Field(default_factory=Queues)
    redis: Redis | None = Field(None, description="Shared Redis queue; in-process queues when unset.")
    circuit_breaker: CircuitBreaker = Field(default_factory=CircuitBreaker)
    routing: Literal["kv", "load", "session"] = Field(
        "kv", description="kv: to the worker holding most of the prompt in its prefix cache (its cache events), "
        "weighed with its load; load: least outstanding tokens; session: a session id or the prompt's first 64 "
        "tokens hashed onto a worker.")  # fmt: skip
    cache_index_blocks: int = Field(262144, ge=1, description="Prefix-block hashes the kv routing index keeps "
                                    "(least recently used forgotten first; ~64 MiB at the default).")  # fmt: skip
    sm4_key_secret: str | None = Field(None, description="Secret with SM4-GCM payload keys (key id -> key).")
    thinking_policy: Literal["off", "light", "deep", "auto"] = Field("auto", description="Default thinking mode.")


class Sampling(Spec):
    ascend_temperature_floor: float = Field(0.35, ge=0, description="On Ascend, raise lower temperatures to it.")


class Security(Spec):
    tls_secret: str | None = Field(
        None,
        description="Secret with tls.crt, tls.key and ca.crt (a cert-manager Certificate's): workers and routers "
        "then speak mutual TLS to each other, the router serves its gRPC API over TLS, and probes move to a "
        "plain-text health port. The certificate must name <name>-workers.<namespace>.svc.",
    )
    api_key_secret: SecretKeyRef | None = Field(
        None, description="Secret key holding API keys (one per line): clients must send one as a Bearer token."
    )
    https: bool = Field(False, description="Serve the OpenAI API over HTTPS with the tlsSecret's certificate.")
    require_sealed: bool = Field(False, description="Serve only SM4-sealed gRPC requests (needs sm4KeySecret).")
    network_policy: bool = Field(
        True, description="Render NetworkPolicies: workers accept gRPC only from this deployment's routers and the "
        "RL jobs that use it."
    )  # fmt: skip
    router_ingress_from: list[dict[str, Any]] | None = Field(
        None, description="NetworkPolicy peers allowed to reach the router (default: anyone)."
    )
    health_port: int = Field(8081, ge=1, le=65535, description="Plain-text gRPC health port for probes under TLS.")


class Prometheus(Spec):
    url: str | None = Field(None, description="Prometheus the autoscaler queries (KEDA; prometheus-adapter has its "
                            "own). Default: the operator's (GLM5_PROMETHEUS_URL).")  # fmt: skip
    selector: str | None = Field(
        None,
        max_length=1024,
        description="PromQL label matchers that select this deployment's router pods' series. Default: namespace, "
        "app_kubernetes_io_instance and app_kubernetes_io_component (what Prometheus' usual kubernetes-pods job "
        "labels a scraped pod with).",
    )


class Autoscaling(Spec):
    min_replicas: int = Field(1, ge=1, description="Fewest model replicas.")
    max_replicas: int = Field(ge=1, description="Most model replicas.")
    metric: Literal["queueDepth", "kvCacheUtilization", "inflightTokens"] = Field(
        "queueDepth",
        description="queueDepth: requests waiting (the routers' queues and the workers' own) per replica; "
        "kvCacheUtilization: the workers' mean share of KV blocks in use; inflightTokens: tokens the routers' "
        "requests may still generate (their max_new_tokens) per replica.",
    )
    target: float = Field(gt=0, description="The metric's value per replica the autoscaler holds (kvCacheUtilization: "
                          "a share, 0..1).")  # fmt: skip
    backend: Literal["auto", "keda", "hpa"] = Field(
        "auto",
        description="keda: a KEDA ScaledObject with a Prometheus trigger; hpa: a HorizontalPodAutoscaler on an "
        "External metric served by prometheus-adapter (with the chart's rules); auto: keda where the ScaledObject "
        "API is served, else hpa.",
    )
    scale_down_stabilization_seconds: int = Field(
        300, ge=0, le=3600, description="Scale down only to the highest replica count wanted over this window."
    )
    polling_interval_seconds: int = Field(15, ge=1, description="How often KEDA queries Prometheus.")
    prometheus: Prometheus = Field(default_factory=Prometheus)


class GLM5DeploymentSpec(Spec):
    model: ModelSource
    sparse_attention: SparseAttention = Field(default_factory=SparseAttention)
    kv_cache: KVCache = Field(default_factory=KVCache)
    workers: Workers = Field(default_factory=Workers)
    router: Router = Field(default_factory=Router)
    sampling: Sampling = Field(default_factory=Sampling)
    security: Security = Field(default_factory=Security)
    autoscaling: Autoscaling | None = Field(
        None,
        description="Scale the model replicas (workers.replicas, through the scale subresource) on a serving "
        "signal; scaled-down workers drain first. Unset: workers.replicas as written.",
    )
