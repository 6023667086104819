"""Small GLM-5-architecture configurations and random-weight checkpoints (`glm5 init-model`).

"tiny" keeps every architectural feature (MLA, DSA with full and shared indexer layers, group-limited MoE
with shared experts, a dense first layer) at sizes that run on a laptop CPU.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from glm5.errors import ConfigError
from glm5.model.config import ModelConfig, RopeConfig
from glm5.model.loader import save_checkpoint
from glm5.model.model import GlmMoeDsaForCausalLM
from glm5.tokenizer.build import EOS_TOKENS, write_tokenizer

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_topk=256,
        index_head_dim=32,
        index_n_heads=8,
        first_k_dense_replace=1,
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        max_position_embeddings=131072,
    ),
}
# The tiny model with the attention geometry llama.cpp's GLM-DSA port accepts (its lightning indexer needs
# index_head_dim >= 64; kv_lora_rank 512 and a 64-wide RoPE part as in GLM-5): the decode-latency comparison's model.
PRESETS["tiny-dsa64"] = {
    **PRESETS["tiny"],
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 64,
}
PRESETS["tiny-shallow"] = {
    **PRESETS["tiny"],
    "num_hidden_layers": 2,
    "indexer_types": ["full", "shared"],
    "mlp_layer_types": ["dense", "sparse"],
}


def preset_config(name: str, vocab_size: int, eos_token_ids: list[int], **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = {**PRESETS[name], **overrides}
    return ModelConfig(
        vocab_size=vocab_size, eos_token_id=eos_token_ids, bos_token_id=None, rope=RopeConfig(), **fields
    )


def init_weights(model: GlmMoeDsaForCausalLM, seed: int, std: float = 0.02) -> None:
    """transformers' initialisation (normal(0, std) linears and experts, unit norms, zero router bias)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()


def init_model(out: str | Path, preset: str = "tiny", seed: int = 0, vocab_size: int = 1024,
               mtp_layers: int = 0) -> Path:  # fmt: skip
    """Writes a random-weight checkpoint with a real tokenizer to `out` and returns the path; with
    `mtp_layers`, that many multi-token-prediction layers too (glm5.model.model), under the checkpoint's names
    (model.layers.{L + i}), sharing the model's LM head."""
    if mtp_layers < 0:
        raise ConfigError(f"--mtp-layers {mtp_layers}: must be >= 0")
    out = Path(out)
    tok = write_tokenizer(out, vocab_size=vocab_size, seed=seed)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    padded = (vocab + 63) // 64 * 64  # embedding rows round up, as real checkpoints do
    eos = [i for t in EOS_TOKENS if (i := tok.token_to_id(t)) is not None]
    config = preset_config(preset, padded, eos, num_nextn_predict_layers=mtp_layers)
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(config, mtp_layers=mtp_layers)
    init_weights(model, seed)
    save_checkpoint(model, out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}, indent=2))
    return out


DEFAULT_MODEL_NAME = "glm5-tiny-random"
# The trained demo model that ships with the package (tiny preset, two-number addition; docs/rl.md).
SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "glm5-tiny-addition"


def glm5_home() -> Path:
    return Path(os.environ.get("GLM5_HOME") or Path.home() / ".cache" / "glm5")


def default_model_path() -> Path:
    """The model served when none is given: the shipped demo model (the tiny preset trained on addition), or,
    where it is absent, the tiny preset with seeded random weights, built on first use (same on every
    machine)."""
    if (SHIPPED_MODEL / "config.json").is_file():
        return SHIPPED_MODEL
    path = glm5_home() / "models" / DEFAULT_MODEL_NAME
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    init_model(tmp, preset="tiny", seed=0)
    try:
        tmp.rename(path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return path
