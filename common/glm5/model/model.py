"""GlmMoeDsaForCausalLM: embeddings -> decoder layers (MLA + DSA, dense MLP or MoE) -> norm -> LM head.

Module and parameter names follow the HuggingFace checkpoint layout (model.layers.N.self_attn.q_a_proj...),
so weights load by name; only the routed experts are stacked (see glm5.model.loader).

A checkpoint's multi-token-prediction (MTP) layers sit after the decoder layers, at model.layers.{L + i}
(L = num_hidden_layers, i < num_nextn_predict_layers), and are built only when asked for (`mtp_layers`): each is
an ordinary decoder block (MLA + indexer + MoE) behind `eh_proj(cat(enorm(embed(next token)), hnorm(h)))`,
where h is the main model's last hidden state (after its final norm) at the position before, followed by
`shared_head.norm` and the LM head (the layer's own `shared_head.head` where the checkpoint stores one). So
the MTP layers' tensors keep the checkpoint's names and load, shard and quantize like any decoder layer's.
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
        # an MTP layer (past the config's lists) is a MoE block, as GLM-5's and DeepSeek-V3's checkpoints store it
        sparse = layer_idx >= config.num_hidden_layers or config.mlp_layer_types[layer_idx] == "sparse"
        self.mlp: MLP | MoE = (
            MoE(config, tp) if sparse else MLP(config.hidden_size, config.intermediate_size // tp.size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def block(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVStorage,
        kernels: DSAKernels,
        controls: DSAControls,
        selection: LayerSelection | None,
        tp: TensorParallel,
    ) -> tuple[torch.Tensor, LayerSelection | None]:
        """The residual block: h + attention(norm(h)), then + MLP(norm(...)); also the layer's top-k selection."""
        attn_out, selection = self.self_attn(self.input_layernorm(h), cos, sin, batch, cache, kernels, controls,
                                             selection)  # fmt: skip
        h = h + tp.all_reduce(attn_out)
        return h + tp.all_reduce(self.mlp(self.post_attention_layernorm(h))), selection


class SharedHead(nn.Module):
    """An MTP layer's output norm, and its own LM head where the checkpoint stores one (else the model's)."""

    def __init__(self, config: ModelConfig, own_head: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        first, stop = tp.span(config.vocab_size)
        self.head = nn.Linear(config.hidden_size, stop - first, bias=False) if own_head else None


class MTPLayer(DecoderLayer):
    """One multi-token-prediction layer (module docstring): a decoder block with its input projection and head.
    Its attention has its own cache rows (layer index L + i) and its own indexer."""

    def __init__(self, config: ModelConfig, layer_idx: int, index_layer: int, own_head: bool,
                 tp: TensorParallel = SINGLE) -> None:  # fmt: skip
        super().__init__(config, layer_idx, index_layer, tp)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config, own_head, tp)


class GlmMoeDsaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE, mtp_layers: int = 0,
                 mtp_heads: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        index_layers = {layer: i for i, layer in enumerate(config.full_indexer_layers)}
        n = config.num_hidden_layers
        layers: list[DecoderLayer] = [DecoderLayer(config, i, index_layers.get(i, -1), tp) for i in range(n)]
        layers += [MTPLayer(config, n + i, len(index_layers) + i, mtp_heads, tp) for i in range(mtp_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GlmMoeDsaForCausalLM(nn.Module):
    """The whole model, or under tensor parallelism (`tp`, glm5.parallel) one rank's shard of it; with
    `mtp_layers` (at most config.num_nextn_predict_layers) also its first MTP layers, with their own LM heads
    when `mtp_heads`."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE, mtp_layers: int = 0,
                 mtp_heads: bool = False) -> None:  # fmt: skip
        super().__init__()
        if not 0 <= mtp_layers <= config.num_nextn_predict_layers:
            raise ValueError(f"mtp_layers {mtp_layers}: the config declares {config.num_nextn_predict_layers}")
        self.config = config
        self.tp = tp
        self.model = GlmMoeDsaModel(config, tp, mtp_layers, mtp_heads)
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

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        """The MTP layers built (after the decoder layers)."""
        return [layer for layer in self.model.layers[self.config.num_hidden_layers :] if isinstance(layer, MTPLayer)]

    def hidden_states(
        self, batch: ForwardBatch, cache: PagedKVStorage, kernels: DSAKernels, controls: DSAControls | None = None
    ) -> torch.Tensor:
        """Runs the decoder layers over the batch and returns every row's last hidden state after the final
        norm (N, H): what the LM head reads, and what an MTP layer drafts from."""
        controls = controls or DSAControls()
        h = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rope(batch.positions, h.dtype)
        selection: LayerSelection | None = None
        for layer in self.model.layers[: self.config.num_hidden_layers]:
            assert isinstance(layer, DecoderLayer)
            h, selection = layer.block(h, cos, sin, batch, cache, kernels, controls, selection, self.tp)
        normed: torch.Tensor = self.model.norm(h)
        return normed

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
        h = self.hidden_states(batch, cache, kernels, controls)
        return self.logits(h if all_logits else h[batch.logits_rows])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over hidden states (after the final norm): (M, V) float32, the whole vocabulary on the
        first rank under tensor parallelism (the others their own slice)."""
        logits: torch.Tensor = self.lm_head(hidden).float()
        return self.tp.gather_last_dim(logits)

    def mtp_forward(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        cache: PagedKVStorage,
        kernels: DSAKernels,
        controls: DSAControls | None = None,
        step: int = 0,
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP layer's step (layer `step` modulo the layers built: one layer applied recursively drafts
        several tokens, as vLLM does). Row i of the batch carries the token that follows position
        batch.positions[i] (batch.input_ids) and `hidden` (N, H) that position's hidden state (from
        hidden_states, or from the previous draft step); the layer writes its cache rows at those positions.
        Returns (logits (M, V) float32 for batch.logits_rows, or all rows; the layer's output (N, H) after
        shared_head.norm, which the next draft step reads as its hidden state)."""
        layers = self.mtp_layers
        if not layers:
            raise ValueError("this model was built without MTP layers")
        layer = layers[step % len(layers)]
        controls = controls or DSAControls()
        embeds = self.model.embed_tokens(batch.input_ids)
        # vLLM's deepseek_mtp and glm4_moe_mtp zero the token embedding at position 0 (the first token has no
        # hidden state before it in training); kept so that a checkpoint's MTP layer sees what it was fitted on
        embeds = embeds.masked_fill((batch.positions == 0)[:, None], 0.0)
        h = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))
        cos, sin = self.rope(batch.positions, h.dtype)
        h, _ = layer.block(h, cos, sin, batch, cache, kernels, controls, None, self.tp)
        out: torch.Tensor = layer.shared_head.norm(h)
        rows = out if all_logits else out[batch.logits_rows]
        head = layer.shared_head.head or self.lm_head
        return self.tp.gather_last_dim(head(rows).float()), out
