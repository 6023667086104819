"""GlmMoeDsaForCausalLM: embeddings -> decoder layers (MLA + DSA, dense MLP or MoE) -> norm -> LM head.

Module and parameter names follow the HuggingFace checkpoint layout (model.layers.N.self_attn.q_a_proj...),
so weights load by name; only the routed experts are stacked (see glm5.model.loader).
"""

from __future__ import annotations

import torch
from torch import nn

from glm5.kernels.base import DSAKernels
from glm5.kvcache.storage import PagedKVStorage
from glm5.model.attention import DSAControls, LayerSelection, MLAttention
from glm5.model.batch import ForwardBatch
from glm5.model.config import ModelConfig
from glm5.model.moe import MLP, MoE
from glm5.model.norms import RMSNorm
from glm5.model.rope import inv_freq_and_scale


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, index_layer: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer_idx, index_layer)
        self.mlp: MLP | MoE = (
            MoE(config)
            if config.mlp_layer_types[layer_idx] == "sparse"
            else MLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GlmMoeDsaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        index_layers = {layer: i for i, layer in enumerate(config.full_indexer_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, index_layers.get(i, -1)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GlmMoeDsaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GlmMoeDsaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # a plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies
        with torch.device("cpu"):  # also when the model is built on the meta device
            self._inv_freq, self._rope_scaling = inv_freq_and_scale(config.rope, config.qk_rope_head_dim)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (N,) -> cos, sin (N, R/2), computed like transformers (float32, then cast)."""
        freqs = positions[:, None].float() * self._inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = freqs.shape[-1]
        cos = (emb.cos() * self._rope_scaling).to(dtype)[:, :half]
        sin = (emb.sin() * self._rope_scaling).to(dtype)[:, :half]
        return cos, sin

    def forward(
        self,
        batch: ForwardBatch,
        cache: PagedKVStorage,
        kernels: DSAKernels,
        controls: DSAControls | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Runs one step and returns logits (M, V) float32 for batch.logits_rows (all rows if all_logits)."""
        controls = controls or DSAControls()
        h = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rope(batch.positions, h.dtype)
        selection: LayerSelection | None = None
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            attn_out, selection = layer.self_attn(
                layer.input_layernorm(h), cos, sin, batch, cache, kernels, controls, selection
            )
            h = h + attn_out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if not all_logits:
            h = h[batch.logits_rows]
        logits: torch.Tensor = self.lm_head(self.model.norm(h)).float()
        return logits
