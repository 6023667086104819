"""The engine configuration resolved once at start-up: flags plus what the checkpoint and the machine say (device,
dtypes, RoPE override, context limit, KV cache geometry). Every rank of a replica resolves the same flags to
the same object, so each part of the engine gets this one object instead of a list of loose arguments."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from glm5.devices import resolve_device
from glm5.errors import ConfigError
from glm5.model.config import ModelConfig, RopeConfig
from glm5.model.loader import checkpoint_files, mtp_layers_stored, parse_dtype, stored_dtypes
from glm5.model.presets import default_model_path
from glm5.model.quant import check_quantization
from glm5.parallel import check_divisible

from glm5_worker.config import AUTO, DEFAULT_MAX_MODEL_LEN, EngineConfig, SpeculativeConfig
from glm5_worker.kv.sizing import CacheSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    engine: EngineConfig
    model_dir: Path
    model: ModelConfig  # with the RoPE override applied
    device: torch.device  # the device type; a rank's own device adds its local index (device_for)
    dtype: torch.dtype
    kv_dtype: torch.dtype  # L1 latents and rope keys (may be narrower than the model)
    index_dtype: torch.dtype  # L1 indexer keys
    max_model_len: int
    served_model_name: str

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine.tensor_parallel_size

    def device_for(self, local_rank: int) -> torch.device:
        """Rank `local_rank` of this host uses device `local_rank` (the device plugin made exactly ours visible)."""
        if self.device.type == "cpu":
            return self.device
        return torch.device(self.device.type, local_rank)

    @property
    def cache(self) -> CacheSpec:
        c = self.engine
        return CacheSpec(
            model=self.model,
            dtype=self.kv_dtype,
            index_dtype=self.index_dtype,
            block_size=c.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=c.max_num_seqs,
            max_chunk=c.max_num_batched_tokens,
            l1_tokens=c.l1_tokens if c.kv_int8_tier else 0,
            int8_tier=c.kv_int8_tier,
            mtp_layers=self.mtp_layers,
        )

    @property
    def mtp_layers(self) -> int:
        """MTP layers the worker builds: every one the checkpoint declares when it drafts with them."""
        spec = self.engine.speculative
        return self.model.num_nextn_predict_layers if spec is not None and spec.method == "mtp" else 0


def auto_speculation(config: EngineConfig, model: ModelConfig, model_dir: Path,
                     device_type: str) -> SpeculativeConfig | None:  # fmt: skip
    """What `--speculative-config auto` means for this checkpoint and device: its MTP layer drafting where it
    stores one and the device is an accelerator, else no speculation (glm5_worker.config: AUTO)."""
    spec = config.speculative
    assert spec is not None
    if not model.num_nextn_predict_layers:
        return None
    if device_type == "cpu":
        log.info("speculative decoding off (auto on a CPU, where it cost tokens/s: docs/benchmarks.md r); "
                 "--speculative-config '{\"method\": \"mtp\"}' turns it on")  # fmt: skip
        return None
    if not all(mtp_layers_stored(model, stored_dtypes(checkpoint_files(model_dir)))):
        log.warning("%s declares multi-token-prediction layers but does not store them all: no speculative "
                    "decoding", model_dir)  # fmt: skip
        return None
    return dataclasses.replace(spec, method="mtp")


def resolve(config: EngineConfig) -> ResolvedConfig:
    device = resolve_device(config.device)
    model_dir = Path(config.model) if config.model else default_model_path()
    dtype_name = config.dtype if config.dtype != "auto" else ("float32" if device.type == "cpu" else "bfloat16")
    dtype = parse_dtype(dtype_name)
    kv_dtype = parse_dtype(config.kv_cache_dtype) if config.kv_cache_dtype != "auto" else dtype
    index_dtype = parse_dtype(config.kv_index_dtype) if config.kv_index_dtype != "auto" else kv_dtype
    model = ModelConfig.from_file(model_dir)
    check_quantization(config.quantization, json.loads((model_dir / "config.json").read_text()), str(model_dir))
    base_max_positions = model.max_position_embeddings
    rope = _rope_override(config, model)
    if rope is not None:
        model.rope = rope
    check_divisible(model, config.tensor_parallel_size, config.is_expert_parallel)
    spec = config.speculative
    if spec is not None and spec.method == AUTO:
        spec = auto_speculation(config, model, model_dir, device.type)
        config = dataclasses.replace(config, speculative=spec)
    if spec is not None and spec.method == "mtp" and not model.num_nextn_predict_layers:
        raise ConfigError(f"--speculative-config method mtp: {model_dir} has no multi-token-prediction "
                          "layers (config.json num_nextn_predict_layers is 0); use method ngram or none")  # fmt: skip
    if config.dense_warmup_tokens > 0 and config.dense_warmup_tokens > model.index_topk:
        log.warning(
            "dense warm-up (%d tokens) exceeds index_topk (%d): early tokens attend more than the model was trained "
            "with", config.dense_warmup_tokens, model.index_topk,
        )  # fmt: skip
    return ResolvedConfig(
        engine=config,
        model_dir=model_dir,
        model=model,
        device=device,
        dtype=dtype,
        kv_dtype=kv_dtype,
        index_dtype=index_dtype,
        max_model_len=_max_model_len(config, base_max_positions),
        served_model_name=config.served_model_name or model_dir.name,
    )


def _rope_override(c: EngineConfig, base: ModelConfig) -> RopeConfig | None:
    if c.rope_scaling is None:
        return None
    assert c.rope_factor is not None
    original = c.rope_original_max_position_embeddings or base.max_position_embeddings
    return RopeConfig(
        rope_type=c.rope_scaling,
        rope_theta=base.rope.rope_theta,
        factor=c.rope_factor,
        original_max_position_embeddings=original if c.rope_scaling == "yarn" else None,
    )


def _max_model_len(c: EngineConfig, max_positions: int) -> int:
    limit = max_positions
    if c.rope_scaling is not None:
        assert c.rope_factor is not None
        limit = int((c.rope_original_max_position_embeddings or max_positions) * c.rope_factor)
    if c.max_model_len is None:
        return min(DEFAULT_MAX_MODEL_LEN, limit)
    if c.max_model_len > limit:
        raise ConfigError(
            f"--max-model-len {c.max_model_len} exceeds the {limit} positions this checkpoint supports; "
            "add RoPE scaling (--rope-scaling yarn --rope-factor N) or lower it"
        )
    return c.max_model_len
