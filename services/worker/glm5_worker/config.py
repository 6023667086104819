"""Engine configuration: one validated dataclass built at start-up from flags and passed down."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from glm5.devices import DEVICE_CHOICES
from glm5.errors import ConfigError
from glm5.kernels import KERNEL_CHOICES
from glm5.model.config import validate_rope_factor
from glm5.model.quant import QUANTIZATION_CHOICES
from glm5.settings import derived, setting
from glm5.units import parse_bytes

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


DTYPES = ("auto", "float32", "bfloat16", "float16")
PARALLEL = "one replica over several devices (docs/scaling.md)"
COMPILED = "compiled decode steps (docs/worker.md)"


@dataclass(slots=True)
class EngineConfig:
    """Every engine setting; each field's flag (`glm5 worker --help`) is declared with it (glm5.settings)."""

    model: str | None = setting(None, help="HuggingFace-format checkpoint directory (default: the built-in tiny "
                                "model)")  # fmt: skip
    served_model_name: str | None = setting(None, help="name reported to clients (default: the directory name)")
    dtype: str = setting("auto", choices=DTYPES, help="weights and activations (auto: the checkpoint's; float32 on "
                         "a CPU, bfloat16 on accelerators)")  # fmt: skip
    quantization: str = setting("auto", choices=QUANTIZATION_CHOICES,
                                help="weight format the checkpoint must have: fp8 (block FP8), compressed-tensors "
                                "(INT4 / FP8), none (float); auto loads whatever it stores")  # fmt: skip
    device: str = setting("auto", choices=DEVICE_CHOICES, help="accelerator (auto: an Ascend NPU, else CUDA, else "
                          "the CPU)")  # fmt: skip
    kernels: str = setting("auto", choices=KERNEL_CHOICES, help="DSA kernels: auto = Triton on CUDA when installed, "
                           "else portable PyTorch")  # fmt: skip
    max_model_len: int | None = setting(None, help="context limit (default min(131072, the checkpoint's max "
                                        "positions x RoPE factor))")  # fmt: skip
    rope_scaling: str | None = setting(None, choices=("linear", "yarn"), help="override the checkpoint's RoPE "
                                       "scaling")  # fmt: skip
    rope_factor: float | None = setting(None, help="RoPE scaling factor, a power of two")
    rope_original_max_position_embeddings: int | None = setting(
        None, help="context the model was trained on, for --rope-scaling (default: the checkpoint's)"
    )
    # KV cache
    block_size: int = setting(64, help="tokens per KV block")
    kv_cache_bytes: int | None = setting(None, given="auto", type=str, convert=parse_bytes,
                                         help="KV pool size ('auto' (glm5_worker.kv.sizing), or e.g. 512MiB, "
                                         "4GiB)")  # fmt: skip
    kv_memory_fraction: float = setting(0.9, help="--kv-cache-bytes auto: share of free device memory for the pool "
                                        "(kv-cache.md)")  # fmt: skip
    kv_cpu_max_bytes: int = setting(4 << 30, help="--kv-cache-bytes auto on a CPU: the pool's cap in bytes")
    kv_int8_tier: bool = setting(True, help="L2: tokens older than --l1-tokens stored as INT8 with per-token "
                                 "scales (--no-kv-int8-tier: every token at model precision)")  # fmt: skip
    kv_cache_dtype: str = setting("auto", choices=DTYPES, help="L1 latents and rope keys (auto: the model dtype); "
                                  "bfloat16 halves them for a float32 model, read back into float32 for "
                                  "attention")  # fmt: skip
    kv_index_dtype: str = setting("auto", choices=DTYPES, help="L1 indexer keys (auto: --kv-cache-dtype); bfloat16 "
                                  "halves them for a float32 model and speeds up long-context top-k "
                                  "selection")  # fmt: skip
    l1_tokens: int = setting(128, help="recent tokens kept at model precision")
    enable_prefix_caching: bool = setting(True, name="prefix-caching", help="reuse KV blocks of shared prompt "
                                          "prefixes")  # fmt: skip
    cache_event_log: int = setting(65536, help="prefix-cache events kept for routers that route by cache "
                                   "(--routing kv); a router further behind gets a snapshot")  # fmt: skip
    # scheduling
    max_num_seqs: int = setting(64, help="sequences running at once")
    max_num_batched_tokens: int = setting(2048, help="per-step token budget; longer prompts are prefilled in "
                                          "chunks")  # fmt: skip
    max_waiting: int = setting(1024, help="queued requests; beyond it they are refused")
    default_max_new_tokens: int = setting(256, help="max new tokens of a request that sets none")
    # DSA runtime controls
    dense_warmup_tokens: int = setting(
        128, help="queries at positions below it attend to every earlier token (docs/worker.md; 0 disables it)"
    )
    paged_scoring_min_tokens: int = setting(8192, help="decode contexts this long score indexer keys in place")
    dynamic_sparsity: bool = setting(False, help="widen top-k when attention entropy is low")
    sparsity_entropy_threshold: float = setting(0.85, help="--dynamic-sparsity: widen top-k below this mean "
                                                "attention entropy (nats)")  # fmt: skip
    sparsity_patience: int = setting(3, help="--dynamic-sparsity: measurements below (or back above) the threshold "
                                     "to act")  # fmt: skip
    sparsity_widen_factor: float = setting(1.5, help="--dynamic-sparsity: top-k multiplier when widening")
    entropy_interval: int = setting(8, help="measure attention entropy every N engine steps")
    # compiled decode steps (glm5_worker.runner.compiled): vLLM's --enforce-eager turns them off
    enforce_eager: bool = setting(default_factory=_eager_by_default, group=COMPILED,
                                  help="run every step eagerly (default: decode steps of up to --compile-max-batch "
                                  "sequences run as compiled graphs, compiled at start-up and cached on disk; CPU "
                                  "only so far)")  # fmt: skip
    compile_max_batch: int = setting(8, group=COMPILED, help="largest decode batch that runs compiled (larger ones "
                                     "are not dispatch-bound)")  # fmt: skip
    compile_cache_dir: str | None = setting(
        None,
        group=COMPILED,
        help="where compiled steps are kept between starts (default: $GLM5_COMPILE_CACHE or ~/.cache/glm5/compile)",
    )
    compile_budget_s: float = setting(600.0, name="compile-budget", group=COMPILED,
                                      help="seconds start-up may spend compiling; shapes not compiled by then run "
                                      "eagerly")  # fmt: skip
    # sampling guards
    ascend_temperature_floor: float = setting(0.35, help="on an Ascend NPU a temperature in (0, floor) is raised "
                                              "to it; 0 stays greedy")  # fmt: skip
    seed: int = setting(0, help="sampler seed of requests without their own")
    jitter_window: int = setting(256, help="decode step times the latency jitter is taken over ...")
    jitter_window_s: float = setting(30.0, name="jitter-window-seconds", help="... none older than this (an idle "
                                     "worker's jitter fades)")  # fmt: skip
    # one model replica over several devices (glm5_worker.parallel; docs/scaling.md)
    tensor_parallel_size: int = setting(1, aliases=("-tp",), group=PARALLEL, help="devices (ranks) one model "
                                        "replica spans; the worker starts ranks 1..N-1 itself")  # fmt: skip
    expert_parallel: bool | None = setting(None, group=PARALLEL, help="partition the routed experts over the ranks "
                                           "(default: on when the size is > 1); --no-expert-parallel splits every "
                                           "expert's intermediate dimension instead")  # fmt: skip
    nnodes: int = setting(1, group=PARALLEL, help="hosts (pods) the replica spans; each runs "
                          "--tensor-parallel-size / --nnodes ranks")  # fmt: skip
    node_rank: int = setting(0, group=PARALLEL, help="this host's index; hosts other than 0 run follower ranks "
                             "only (no gRPC server)")  # fmt: skip
    master_addr: str = setting("127.0.0.1", group=PARALLEL, help="host of rank 0 (the first pod's DNS name)")
    master_port: int = setting(0, group=PARALLEL, help="rank 0's rendezvous port (0: any; one host only)")
    collective_timeout_s: float = setting(120.0, name="collective-timeout", group=PARALLEL,
                                          help="seconds a collective (or the idle heartbeat) may take before the "
                                          "replica is declared lost")  # fmt: skip
    startup_timeout_s: float = setting(1800.0, name="startup-timeout", group=PARALLEL,
                                       help="seconds the ranks wait for each other to start and to load their "
                                       "shards")  # fmt: skip
    # speculative decoding (glm5_worker.engine.speculative); None: off
    speculative: SpeculativeConfig | None = derived(None, why="--speculative-config, parsed for the device named "
                                                    "(glm5_worker.cli)")  # fmt: skip

    def __post_init__(self) -> None:
        if self.device not in DEVICE_CHOICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {self.device!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ConfigError(f"--kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        for flag, value in (("--kv-cache-dtype", self.kv_cache_dtype), ("--kv-index-dtype", self.kv_index_dtype)):
            if value not in DTYPES:
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
