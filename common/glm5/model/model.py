"""GlmMoeDsaForCausalLM: embeddings -> decoder layers (MLA + DSA, dense MLP or MoE) -> norm -> LM head.

Module and parameter names follow the HuggingFace checkpoint layout (model.layers.N.self_attn.q_a_proj...),
so weights load by name; only the routed experts are stacked (see glm5.model.loader).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm5.kernels.base import DSAKernels
from glm5.kvcache.storage import PagedKVStorage
from glm5.model.attention import DSAControls, LayerSelection, MLAttention
from glm5.model.batch import ForwardBatch
from glm5.model.config import ModelConfig
from glm5.model.moe import MLP, MoE
from glm5.model.norms import RMSNorm
from glm5.model.rope import inv_freq_and_scale
from glm5.parallel import SINGLE, TensorParallel


class VocabEmbedding(nn.Module):
    """Token embeddings; under tensor parallelism each rank holds a contiguous slice of the vocabulary rows and
    the ranks' lookups (zeros for ids outside a slice) are summed, so exactly one rank contributes each row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.first, stop = tp.span(vocab_size)
        self.weight = nn.Parameter(torch.empty(stop - self.first, hidden_size))
        nn.init.normal_(self.weight)  # nn.Embedding's initialisation

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, index_layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer_idx, index_layer, tp)
        self.mlp: MLP | MoE = (
            MoE(config, tp)
            if config.mlp_layer_types[layer_idx] == "sparse"
            else MLP(config.hidden_size, config.intermediate_size // tp.size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GlmMoeDsaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        index_layers = {layer: i for i, layer in enumerate(config.full_indexer_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, index_layers.get(i, -1), tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GlmMoeDsaForCausalLM(nn.Module):
    """The whole model, or under tensor parallelism (`tp`, glm5.parallel) one rank's shard of it."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = GlmMoeDsaModel(config, tp)
        first, stop = tp.span(config.vocab_size)
        self.lm_head = nn.Linear(config.hidden_size, stop - first, bias=False)
        # a plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies
        with torch.device("cpu"):  # also when the model is built on the meta device
            self._inv_freq, self._rope_scaling = inv_freq_and_scale(config.rope, config.qk_rope_head_dim)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_input_projections(self) -> int:
        """The projections that read one input as one matrix product (glm5.model.fused), for serving: each
        attention's q_a / kv_a / indexer wk / weights_proj, each MLP's (and shared expert's) gate / up. Returns
        the number of projections fused."""
        n = 0
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            mlp = layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp
            n += layer.self_attn.fuse_input_projections() + mlp.fuse_input_projections()
        return n

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
        """Runs one step and returns logits (M, V) float32 for batch.logits_rows (all rows if all_logits).
        Under tensor parallelism the first rank gets the whole vocabulary; the others their own slice."""
        controls = controls or DSAControls()
        tp = self.tp
        h = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rope(batch.positions, h.dtype)
        selection: LayerSelection | None = None
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            attn_out, selection = layer.self_attn(
                layer.input_layernorm(h), cos, sin, batch, cache, kernels, controls, selection
            )
            h = h + tp.all_reduce(attn_out)
            h = h + tp.all_reduce(layer.mlp(layer.post_attention_layernorm(h)))
        if not all_logits:
            h = h[batch.logits_rows]
        logits: torch.Tensor = self.lm_head(self.model.norm(h)).float()
        return tp.gather_last_dim(logits)
