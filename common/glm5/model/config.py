"""GlmMoeDsa model configuration, read from a HuggingFace `config.json`.

Field names and defaults follow transformers' `GlmMoeDsaConfig` (5.23.0) so a real GLM-5 checkpoint's
config.json loads unchanged; derived per-layer patterns (indexer_types, mlp_layer_types) are computed the
same way as there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from glm5.errors import CheckpointError, ConfigError

ARCHITECTURE = "GlmMoeDsaForCausalLM"
MODEL_TYPE = "glm_moe_dsa"
ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(slots=True)
class RopeConfig:
    """RoPE parameters (transformers' `rope_parameters`). Only the rope slice of each head rotates."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope type {self.rope_type!r} is not supported; use one of {', '.join(ROPE_TYPES)}")
        if self.rope_type != "default":
            validate_rope_factor(self.factor)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
        raw = dict(raw)
        rope_type = raw.pop("rope_type", raw.pop("type", "default"))
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known and v is not None}
        if rope_type == "yarn":
            kwargs.setdefault("original_max_position_embeddings", max_position_embeddings)
        factor = kwargs.get("factor", 1.0)
        if rope_type == "yarn" and "factor" not in kwargs:
            factor = max_position_embeddings / kwargs["original_max_position_embeddings"]
        kwargs["factor"] = float(factor)
        return cls(rope_type=rope_type, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type != "default":
            out["factor"] = self.factor
        if self.rope_type == "yarn":
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
            for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
                value = getattr(self, key)
                if value is not None:
                    out[key] = value
        return out


def validate_rope_factor(factor: float) -> None:
    """RoPE scaling factors must be powers of two (2, 4, 8, ...), as the deployment guide requires."""
    if factor < 1 or not math.log2(factor).is_integer():
        raise ConfigError(f"RoPE scaling factor must be a power of two (2, 4, 8, ...), got {factor:g}")


@dataclass(slots=True)
class ModelConfig:
    """Architecture hyper-parameters of a GlmMoeDsaForCausalLM checkpoint."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    bos_token_id: int | None = 0
    eos_token_id: list[int] = field(default_factory=lambda: [1])
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    first_k_dense_replace: int = 3
    indexer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Weights kept on disk for multi-token prediction live at layer indices >= num_hidden_layers.
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "n_routed_experts", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
            "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
            "index_topk", "index_head_dim", "index_n_heads",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be > 0, got {getattr(self, name)}")
        if self.hidden_act != "silu":
            raise ConfigError(f"config.json: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(
                "config.json: qk_rope_head_dim must be even and no larger than index_head_dim "
                f"(got {self.qk_rope_head_dim} and {self.index_head_dim})"
            )
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"config.json: n_routed_experts ({self.n_routed_experts}) must divide into n_group "
                f"({self.n_group}) groups"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(f"config.json: topk_group ({self.topk_group}) > n_group ({self.n_group})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("config.json: num_experts_per_tok exceeds n_routed_experts")
        experts_per_group = self.n_routed_experts // self.n_group
        if experts_per_group < 2:
            # the group score is the sum of each group's two best experts (DeepSeek-V3 routing)
            raise ConfigError("config.json: each expert group needs at least 2 experts")
        if self.num_experts_per_tok > self.topk_group * experts_per_group:
            raise ConfigError("config.json: num_experts_per_tok exceeds the experts in topk_group groups")
        n = self.num_hidden_layers
        if len(self.indexer_types) != n or any(t not in ("full", "shared") for t in self.indexer_types):
            raise ConfigError(f"config.json: indexer_types must list 'full' or 'shared' for each of {n} layers")
        if self.indexer_types[0] != "full":
            raise ConfigError("config.json: the first layer's indexer must be 'full' (shared layers reuse it)")
        if len(self.mlp_layer_types) != n or any(t not in ("dense", "sparse") for t in self.mlp_layer_types):
            raise ConfigError(f"config.json: mlp_layer_types must list 'dense' or 'sparse' for each of {n} layers")

    # Derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer for MLA: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def full_indexer_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    @property
    def num_full_indexer_layers(self) -> int:
        return len(self.full_indexer_layers)

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale; YaRN with mscale_all_dim multiplies it by mscale^2 (DeepSeek-V3)."""
        scale: float = self.qk_head_dim**-0.5  # the same pow as transformers (bit-equal)
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    # Parsing
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if ARCHITECTURE not in archs and model_type != MODEL_TYPE:
            raise CheckpointError(
                f"unsupported architecture {archs or model_type!r}: this engine serves {ARCHITECTURE} "
                f"(model_type {MODEL_TYPE!r})"
            )
        defaults = {f.name: f.default for f in fields(cls)}
        known = set(defaults) - {"rope", "indexer_types", "mlp_layer_types", "eos_token_id"}
        kwargs: dict[str, Any] = {k: raw[k] for k in known if k in raw and raw[k] is not None}
        if "num_experts" in raw and raw["num_experts"] is not None:
            kwargs["n_routed_experts"] = raw["num_experts"]
        eos = raw.get("eos_token_id", 1)
        kwargs["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        n = int(kwargs.get("num_hidden_layers", defaults["num_hidden_layers"]))
        kwargs["indexer_types"] = _indexer_types(raw, n)
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_dense = min(int(kwargs.get("first_k_dense_replace", defaults["first_k_dense_replace"])), n)
            mlp_types = ["dense"] * n_dense + ["sparse"] * (n - n_dense)
        kwargs["mlp_layer_types"] = list(mlp_types)
        max_pos = int(kwargs.get("max_position_embeddings", defaults["max_position_embeddings"]))
        rope_raw = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if "rope_theta" not in rope_raw and raw.get("rope_theta") is not None:
            rope_raw["rope_theta"] = raw["rope_theta"]
        try:
            kwargs["rope"] = RopeConfig.from_dict(rope_raw, max_pos)
            return cls(**kwargs)
        except TypeError as exc:  # wrong value types in config.json
            raise ConfigError(f"config.json: {exc}") from exc

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise CheckpointError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """A config.json that both this engine and transformers 5.23 read."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for f in fields(self):
            if f.name == "rope":
                continue
            out[f.name] = getattr(self, f.name)
        out["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        out["num_key_value_heads"] = self.num_attention_heads
        out["rope_parameters"] = self.rope.to_dict()
        return out


def _indexer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Same precedence as transformers: explicit list, then a pattern string, then freq/offset."""
    if raw.get("indexer_types") is not None:
        return list(raw["indexer_types"])
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            try:
                return [{"F": "full", "S": "shared"}[c] for c in pattern]
            except KeyError as exc:
                raise ConfigError(f"config.json: index_topk_pattern may contain only F and S, got {pattern!r}") from exc
        return list(pattern)
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(num_layers)]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
