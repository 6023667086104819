"""Engine configuration: one validated dataclass built at start-up from flags and passed down."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from glm5.devices import DEVICE_CHOICES
from glm5.errors import ConfigError
from glm5.kernels import KERNEL_CHOICES
from glm5.model.config import validate_rope_factor

DEFAULT_MAX_MODEL_LEN = 131072

# speculative decoding (glm5_worker.engine.speculative runs it): vLLM's --speculative-config methods and keys
METHODS = ("mtp", "ngram", "auto")
AUTO = "auto"  # mtp where the checkpoint stores an MTP layer; else off
AUTO_SPECULATIVE_TOKENS = 3  # vLLM's GLM-5 recipe
MAX_SPECULATIVE_TOKENS = 8
_KEYS = {"method", "num_speculative_tokens", "disable_by_batch_size", "prompt_lookup_max", "prompt_lookup_min"}


# On a CPU a step's cost grows with its rows (each row's attention and indexer work, not the weights' reads,
# dominates): with prompt lookup on the demo model, speculation gave 1.17x at batch 1 (k = 1) and 0.81x / 0.49x of
# the throughput without it at batch 2 / 4 (docs/benchmarks.md r), so by default a CPU worker drafts only while
# one sequence decodes.
CPU_DISABLE_BY_BATCH_SIZE = 1


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "mtp"
    num_speculative_tokens: int = 1
    disable_by_batch_size: int | None = None  # no drafting while more sequences than this run (vLLM's rule)
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up
    prompt_lookup_min: int = 1  # ngram: shortest

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"--speculative-config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"--speculative-config num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}, "
                              f"got {k!r}")  # fmt: skip
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or d < 1):
            raise ConfigError(f"--speculative-config disable_by_batch_size must be an integer >= 1, got {d!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
            raise ConfigError(f"--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, "
                              f"got {lo!r} and {hi!r}")  # fmt: skip

    @classmethod
    def parse(cls, text: str | None, device_type: str = "cpu") -> SpeculativeConfig | None:
        """vLLM's flag value: a JSON object, or none / empty for no speculation. Without disable_by_batch_size,
        a CPU worker speculates only while one sequence decodes (CPU_DISABLE_BY_BATCH_SIZE); an accelerator
        always does (vLLM's default)."""
        if text is None or text.strip().lower() in ("", "none", "null", "off"):
            return None
        if text.strip().lower() == AUTO:
            text = json.dumps({"method": AUTO})
        try:
            raw: Any = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--speculative-config must be a JSON object or none: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--speculative-config must be a JSON object, e.g. "
                              '\'{"method": "mtp", "num_speculative_tokens": 3}\'')  # fmt: skip
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown keys {', '.join(unknown)} (known: "
                              f"{', '.join(sorted(_KEYS))})")  # fmt: skip
        if raw.get("method") in ("deepseek_mtp", "glm4_moe_mtp"):  # vLLM's older spellings of the same method
            raw["method"] = "mtp"
        if raw.get("method") == AUTO:
            raw.setdefault("num_speculative_tokens", AUTO_SPECULATIVE_TOKENS)
        if "disable_by_batch_size" not in raw and device_type == "cpu":
            raw["disable_by_batch_size"] = CPU_DISABLE_BY_BATCH_SIZE
        return cls(**raw)

    def flag(self) -> str:
        """The flag value that gives this config back (passed to the other ranks and processes)."""
        return json.dumps({k: getattr(self, k) for k in sorted(_KEYS)})


def _eager_by_default() -> bool:
    """GLM5_ENFORCE_EAGER=1 makes --enforce-eager the default (the test suite sets it: compiling every test's
    engine would cost minutes; the tests that check compiled steps ask for them)."""
    return os.environ.get("GLM5_ENFORCE_EAGER", "") not in ("", "0")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory; None serves the default model
    served_model_name: str | None = None
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on accelerators
    quantization: str = "auto"  # the checkpoint's weight format must be this one (auto: whatever it stores)
    device: str = "auto"
    kernels: str = "auto"  # DSA kernels: auto = Triton on CUDA when installed, else portable PyTorch
    max_model_len: int | None = None  # default: min(131072, the checkpoint's max positions x RoPE factor)
    rope_scaling: str | None = None  # override the checkpoint: "linear" | "yarn"
    rope_factor: float | None = None
    rope_original_max_position_embeddings: int | None = None
    # KV cache
    block_size: int = 64
    kv_cache_bytes: int | None = None  # None = auto (see glm5_worker.kv.sizing)
    kv_memory_fraction: float = 0.9
    kv_cpu_max_bytes: int = 4 << 30
    kv_int8_tier: bool = True  # L2: tokens older than l1_tokens stored as INT8 with per-token scales
    kv_cache_dtype: str = "auto"  # L1 latents + rope keys: auto = the model dtype; bfloat16 halves them in float32
    kv_index_dtype: str = "auto"  # L1 indexer keys: auto = kv_cache_dtype; bfloat16 halves them in float32
    l1_tokens: int = 128
    enable_prefix_caching: bool = True
    cache_event_log: int = 65536  # prefix-cache events kept for routers (kv.events); one further behind resyncs
    # scheduling
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget; longer prompts are prefilled in chunks
    max_waiting: int = 1024
    default_max_new_tokens: int = 256
    # DSA runtime controls
    dense_warmup_tokens: int = 128
    paged_scoring_min_tokens: int = 8192  # decode contexts this long score indexer keys in place
    dynamic_sparsity: bool = False
    sparsity_entropy_threshold: float = 0.85
    sparsity_patience: int = 3
    sparsity_widen_factor: float = 1.5
    entropy_interval: int = 8  # measure attention entropy every N engine steps
    # compiled decode steps (glm5_worker.runner.compiled): vLLM's --enforce-eager turns them off
    enforce_eager: bool = field(default_factory=_eager_by_default)
    compile_max_batch: int = 8  # decode batches up to this size run compiled; larger ones eager
    compile_cache_dir: str | None = None  # None: $GLM5_COMPILE_CACHE or ~/.cache/glm5/compile
    compile_budget_s: float = 600.0  # start-up compiling stops after this; what is left runs eager
    # sampling guards
    ascend_temperature_floor: float = 0.35
    seed: int = 0
    jitter_window: int = 256  # decode step times the latency jitter is taken over ...
    jitter_window_s: float = 30.0  # ... none older than this (an idle worker's jitter fades)
    # one model replica over several devices (glm5_worker.parallel; docs/scaling.md)
    tensor_parallel_size: int = 1  # ranks per replica, one device each
    expert_parallel: bool | None = None  # routed experts partitioned over ranks; None: on when the size > 1
    nnodes: int = 1  # hosts (pods) the replica spans; each runs tensor_parallel_size / nnodes ranks
    node_rank: int = 0  # this host's index; ranks node_rank * local .. + local - 1
    master_addr: str = "127.0.0.1"  # where rank 0 listens for the others (the first pod's DNS name)
    master_port: int = 0  # 0: a free port (one host only)
    collective_timeout_s: float = 120.0  # a collective (or the idle heartbeat) that takes longer fails the replica
    startup_timeout_s: float = 1800.0  # ranks wait this long for each other to load their shards
    # speculative decoding (glm5_worker.engine.speculative): vLLM's --speculative-config; None: off
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICE_CHOICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {self.device!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ConfigError(f"--kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        for flag, value in (("--kv-cache-dtype", self.kv_cache_dtype), ("--kv-index-dtype", self.kv_index_dtype)):
            if value not in ("auto", "float32", "bfloat16", "float16"):
                raise ConfigError(f"{flag} must be auto, float32, bfloat16 or float16, got {value!r}")
        if self.rope_scaling not in (None, "linear", "yarn"):
            raise ConfigError(f"--rope-scaling must be linear or yarn, got {self.rope_scaling!r}")
        if self.rope_scaling and self.rope_factor is None:
            raise ConfigError("--rope-scaling needs --rope-factor")
        if self.rope_factor is not None:
            validate_rope_factor(self.rope_factor)
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "default_max_new_tokens")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be > 0, got {self.max_model_len}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError("--kv-cache-bytes must be > 0 or 'auto'")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ConfigError("kv_memory_fraction must be in (0, 1]")
        if self.cache_event_log < 1:
            raise ConfigError("--cache-event-log must be >= 1")
        if self.l1_tokens < 0 or self.dense_warmup_tokens < 0:
            raise ConfigError("l1_tokens and dense_warmup_tokens must be >= 0")
        if self.sparsity_widen_factor < 1 or self.sparsity_patience < 1 or self.entropy_interval < 1:
            raise ConfigError("sparsity_widen_factor must be >= 1; sparsity_patience, entropy_interval >= 1")
        if self.compile_max_batch < 1 or self.compile_budget_s <= 0:
            raise ConfigError("--compile-max-batch must be >= 1 and --compile-budget > 0 seconds")
        if self.ascend_temperature_floor < 0:
            raise ConfigError("ascend_temperature_floor must be >= 0")
        self._check_parallel()

    def _check_parallel(self) -> None:
        n = self.tensor_parallel_size
        if n < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got {n}")
        if self.nnodes < 1 or n % self.nnodes:
            raise ConfigError(f"--nnodes ({self.nnodes}) must be >= 1 and divide --tensor-parallel-size ({n})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ConfigError("a replica over several hosts needs --master-port (all hosts must agree on it)")
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port must be in [0, 65535], got {self.master_port}")
        if self.collective_timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ConfigError("--collective-timeout and --startup-timeout must be > 0 seconds")

    @property
    def is_expert_parallel(self) -> bool:
        return self.expert_parallel if self.expert_parallel is not None else self.tensor_parallel_size > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes
