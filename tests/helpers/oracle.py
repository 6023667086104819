"""The transformers GlmMoeDsaForCausalLM oracle, and a minimal runner of our model over the paged cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from glm5.kernels import PortableKernels
from glm5.kvcache.storage import KVLayout, PagedKVStorage
from glm5.model.attention import DSAControls
from glm5.model.batch import DecodeGroup, ForwardBatch, PrefillChunk
from glm5.model.model import GlmMoeDsaForCausalLM
from safetensors.torch import load_file, save_file

TINY: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=1, topk_group=1,
    num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
    qk_nope_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=16, first_k_dense_replace=1,
    initializer_range=0.2, max_position_embeddings=4096,
)  # fmt: skip


def hf_checkpoint(path: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Builds a random transformers model (weights scaled so indexer scores rarely tie) and saves it."""
    from transformers import GlmMoeDsaConfig
    from transformers import GlmMoeDsaForCausalLM as HF

    torch.manual_seed(seed)
    hf = HF(GlmMoeDsaConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("norm.bias"):
                p.normal_(0.0, 0.1)
        for m in hf.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    hf.save_pretrained(path)
    return hf


def mtp_checkpoint(path: Path, layers: int, seed: int = 0, **overrides: Any) -> dict[str, torch.Tensor]:
    """A transformers model with `layers` + 1 layers saved as a `layers`-layer checkpoint whose last layer is an
    MTP layer (its decoder block is transformers' layer `layers`; enorm, hnorm, eh_proj and shared_head.norm
    random; a garbage copy of the embeddings, which must not be read). Returns the tensors written."""
    n = layers
    shape = {"num_hidden_layers": n + 1, "mlp_layer_types": ["dense"] + ["sparse"] * n,
             "indexer_types": ["full"] * (n + 1)}  # fmt: skip
    cfg = hf_checkpoint(path, seed=seed, **{**shape, **overrides}).config
    tensors = load_file(path / "model.safetensors")
    h = cfg.hidden_size
    g = torch.Generator().manual_seed(seed + 1)
    tensors |= {
        f"model.layers.{n}.enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"model.layers.{n}.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"model.layers.{n}.eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=g),
        f"model.layers.{n}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"model.layers.{n}.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g) * 50,
    }
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config |= {"num_hidden_layers": n, "num_nextn_predict_layers": 1, "indexer_types": ["full"] * n}
    for key in ("mlp_layer_types", "layer_types"):  # the MTP layer is not one of the decoder layers
        config[key] = config[key][:n]
    (path / "config.json").write_text(json.dumps(config))
    return tensors


class IndexRecorder:
    """Records the top-k indices transformers' indexers return, per layer."""

    def __init__(self, hf: torch.nn.Module) -> None:
        self.indices: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(hf.model.layers):
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, output: torch.Tensor) -> None:
            self.indices[layer] = output.detach().clone()

        return hook


class RecordingKernels(PortableKernels):
    """Portable kernels that keep the top-k positions they return (slots == positions in SimpleRunner)."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def topk(self, scores: torch.Tensor, k: int, ordered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        idx, valid = super().topk(scores, k, ordered)
        self.calls.append((idx.clone(), valid.clone()))
        return idx, valid


class SimpleRunner:
    """One sequence over a paged cache whose slots equal positions: prefill, then token-by-token decode."""

    def __init__(self, model: GlmMoeDsaForCausalLM, max_tokens: int, block_size: int = 16, warmup: int = 0):
        c = model.config
        self.device = dev = next(model.parameters()).device
        blocks = -(-max_tokens // block_size)
        index_layers = {layer: i for i, layer in enumerate(c.full_indexer_layers)}
        mtp = len(model.mtp_layers)  # each with its own cache rows and indexer keys, after the decoder layers'
        slots = tuple(index_layers.get(i, -1) for i in range(c.num_hidden_layers))
        layout = KVLayout(
            c.num_hidden_layers + mtp, c.kv_lora_rank, c.qk_rope_head_dim, c.index_head_dim,
            slots + tuple(range(len(index_layers), len(index_layers) + mtp)), block_size, blocks, 0,
            next(model.parameters()).dtype, dev,
        )  # fmt: skip
        self.model, self.storage = model, PagedKVStorage(layout)
        self.table = torch.arange(blocks, device=dev)
        self.controls = DSAControls(dense_warmup_tokens=warmup)
        self.kernels = RecordingKernels()
        self.length = 0

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        n, p0, dev = ids.shape[0], self.length, self.device
        pos = torch.arange(p0, p0 + n, device=dev)
        chunk = PrefillChunk(0, n, p0 + n, self.table)
        batch = ForwardBatch(ids.to(dev), pos, pos, None, [chunk], torch.arange(n, device=dev))
        self.length += n
        return self.model(batch, self.storage, self.kernels, self.controls)

    @torch.no_grad()
    def decode(self, token: int) -> torch.Tensor:
        p = self.length
        self.length += 1
        dev = self.device
        pos = torch.tensor([p], device=dev)
        group = DecodeGroup(1, self.table[None], torch.tensor([p + 1], device=dev), p + 1)
        batch = ForwardBatch(torch.tensor([token], device=dev), pos, pos, group, [], torch.tensor([0], device=dev))
        return self.model(batch, self.storage, self.kernels, self.controls)[0]

    @torch.no_grad()
    def prefill_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """prefill's step, returning every row's last hidden state (after the final norm) instead of logits."""
        n, p0, dev = ids.shape[0], self.length, self.device
        pos = torch.arange(p0, p0 + n, device=dev)
        batch = ForwardBatch(ids.to(dev), pos, pos, None, [PrefillChunk(0, n, p0 + n, self.table)],
                             torch.arange(n, device=dev))  # fmt: skip
        self.length += n
        return self.model.hidden_states(batch, self.storage, self.kernels, self.controls)

    @torch.no_grad()
    def mtp(self, next_ids: torch.Tensor, hidden: torch.Tensor, start: int, decode: bool = False) -> torch.Tensor:
        """The first MTP layer over positions start.. (row i: the token after position start + i and that
        position's hidden state), its cache rows written at those positions; logits of every row. `decode`: one
        row as a decode step, over the MTP cache rows before it."""
        n, dev = next_ids.shape[0], self.device
        pos = torch.arange(start, start + n, device=dev)
        if decode:
            assert n == 1
            group = DecodeGroup(1, self.table[None], torch.tensor([start + 1], device=dev), start + 1)
            batch = ForwardBatch(next_ids.to(dev), pos, pos, group, [], torch.tensor([0], device=dev))
        else:
            batch = ForwardBatch(next_ids.to(dev), pos, pos, None, [PrefillChunk(0, n, start + n, self.table)],
                                 torch.arange(n, device=dev))  # fmt: skip
        return self.model.mtp_forward(batch, hidden, self.storage, self.kernels, self.controls)[0]


def prompt_ids(vocab: int, n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step_logits(model: GlmMoeDsaForCausalLM, prompt: int = 30, decodes: int = 4) -> list[torch.Tensor]:
    """The logits of a `prompt`-token prefill, then of `decodes` single-token decode steps (fixed random ids)."""
    ids = prompt_ids(model.config.vocab_size, prompt + decodes)
    runner = SimpleRunner(model, len(ids))
    out = [runner.prefill(torch.tensor(ids[:prompt]))]
    out += [runner.decode(t)[None] for t in ids[prompt:]]
    return out


def engine_greedy(path: Path, new_tokens: int = 8) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy tokens our engine generates for two requests on the checkpoint at `path` (a tokenizer is written
    next to it), and its weight bytes per storage dtype."""
    from glm5.tokenizer.build import write_tokenizer
    from glm5_worker.config import EngineConfig
    from glm5_worker.engine.engine import Engine
    from glm5_worker.engine.sequence import SamplingParams

    write_tokenizer(path)
    engine = Engine(EngineConfig(model=str(path), max_model_len=256, kv_cache_bytes=8 << 20, block_size=16))
    for i, n in enumerate((40, 9)):
        ids = prompt_ids(engine.model_config.vocab_size, n)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        engine.add_request(f"r{i}", None, ids, sampling)
    got: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    return got, dict(engine.stats().ranks[0].weight_bytes_by_dtype)


def rewrite_checkpoint(src: Path, out: Path, edit: Any, config_edit: Any = None) -> Path:
    """A copy of the single-file checkpoint at `src` with its tensors (and quantization_config) edited in place."""
    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out
