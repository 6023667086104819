"""Our model against transformers 5.23.0 GlmMoeDsaForCausalLM on tiny random configs (float32).

Sequences are several times longer than index_topk so the sparse selection really drops tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from glm5.model.loader import load_model

from tests.helpers.oracle import IndexRecorder, SimpleRunner, hf_checkpoint

pytestmark = pytest.mark.oracle

CONFIGS = {
    # seq_len 10x index_topk, every layer runs its own indexer
    "long-context": (dict(index_topk=16), 160),
    # group-limited routing: 4 groups, tokens may use experts of 2 of them
    "grouped-moe": (dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, index_topk=12), 72),
    # shared-indexer layers reuse the previous full layer's top-k
    "shared-indexer": (dict(num_hidden_layers=4, index_topk_pattern="FSFS", index_topk=12), 96),
    "yarn-rope": (
        dict(
            index_topk=16,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "rope_theta": 10000.0,
            },
        ),
        80,
    ),
    "linear-rope": (dict(index_topk=16, rope_parameters={"rope_type": "linear", "factor": 2.0}), 64),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    overrides, seq_len = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = hf_checkpoint(path, seed=1, **overrides)
    ours = load_model(path)
    ids = torch.randint(0, hf.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(2))
    recorder = IndexRecorder(hf)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    return hf, ours, ids, ref, recorder.indices


def test_prefill_logits_match(pair) -> None:
    _, ours, ids, ref, _ = pair
    runner = SimpleRunner(ours, ids.shape[1])
    logits = runner.prefill(ids[0])
    assert (logits - ref).abs().max().item() <= 1e-4


def test_decode_through_cache_matches(pair) -> None:
    _, ours, ids, ref, _ = pair
    runner = SimpleRunner(ours, ids.shape[1])
    first = 5
    rows = [runner.prefill(ids[0, :first])]
    rows += [runner.decode(int(t))[None] for t in ids[0, first:]]
    logits = torch.cat(rows)
    assert (logits - ref).abs().max().item() <= 1e-4


def _our_prefill_selection(ours, ids) -> list[tuple[torch.Tensor, torch.Tensor]]:
    runner = SimpleRunner(ours, ids.shape[1])
    runner.prefill(ids[0])
    return runner.kernels.calls


def test_topk_index_sets_match(pair) -> None:
    hf, ours, ids, _, hf_indices = pair
    full_layers = [i for i, t in enumerate(hf.config.indexer_types) if t == "full"]
    calls = _our_prefill_selection(ours, ids)
    assert len(calls) == len(full_layers)
    seq_len = ids.shape[1]
    for layer, (idx, valid) in zip(full_layers, calls, strict=True):
        theirs = hf_indices[layer][0]
        for t in range(seq_len):
            expected = {int(i) for i in theirs[t] if i <= t}
            got = {int(i) for i, v in zip(idx[t], valid[t], strict=True) if v}
            assert got == expected, f"layer {layer} query {t}"
    # the selection must really be sparse for late queries
    assert int(calls[0][1][-1].sum()) == hf.config.index_topk < seq_len


def test_greedy_generation_matches(pair, tmp_path: Path) -> None:
    hf, ours, ids, _, _ = pair
    prompt = ids[:, :24]
    new = 20
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    runner = SimpleRunner(ours, prompt.shape[1] + new)
    token = int(runner.prefill(prompt[0])[-1].argmax())
    out = [token]
    for _ in range(new - 1):
        token = int(runner.decode(token).argmax())
        out.append(token)
    assert out == expected[0, prompt.shape[1] :].tolist()


def test_small_tiles_give_the_same_logits(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill in tiles of a few queries: the early tiles, whose rows see at most top-k tokens, are not
    scored at all, and dense tiles leave out the causally masked context; neither may change a logit."""
    from glm5.model import attention

    _, ours, ids, ref, _ = pair
    monkeypatch.setattr(attention, "SCRATCH_ELEMENTS", 1)
    monkeypatch.setattr(attention, "INDEX_TILE_ELEMENTS", 1)  # one query per selection tile
    monkeypatch.setattr(attention, "SHARED_TILE_ROWS", 3)
    logits = SimpleRunner(ours, ids.shape[1]).prefill(ids[0])
    assert (logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("expanded", [True, False])
def test_both_attention_forms_of_a_masked_prefill_match(pair, monkeypatch: pytest.MonkeyPatch, expanded: bool) -> None:
    """A prefill through the mask path (the picks as a mask over the whole context), in MLA's expanded form
    (per-head keys and values multiplied out of the latents) and in the absorbed one: both give the reference's
    logits."""
    from glm5.model.attention import MLAttention

    _, ours, ids, ref, _ = pair
    monkeypatch.setattr(MLAttention, "expanded_pays", lambda self, n, t: expanded)
    runner = SimpleRunner(ours, ids.shape[1])
    runner.controls.prefill_dense_ratio = 1e9  # every chunk through the mask path
    calls = {"dense_mha": 0, "dense_mla": 0}
    for name in calls:
        inner = getattr(runner.kernels, name)

        def counted(*args, _inner=inner, _name=name, **kwargs):
            calls[_name] += 1
            return _inner(*args, **kwargs)

        monkeypatch.setattr(runner.kernels, name, counted)
    logits = runner.prefill(ids[0])
    assert (logits - ref).abs().max().item() <= 1e-4
    assert (calls["dense_mha"] > 0, calls["dense_mla"] > 0) == (expanded, not expanded)


def test_the_expanded_form_is_taken_where_it_costs_less() -> None:
    """Prefill chunks of many tokens take the expanded form, a few tokens over a long context the absorbed one
    (GLM-5's attention shapes: 64 heads, kv_lora_rank 512, nope 192, rope 64, v 256)."""
    from glm5.model.attention import MLAttention

    attn = MLAttention.__new__(MLAttention)
    attn.kv_lora_rank, attn.nope_dim, attn.rope_dim, attn.v_dim = 512, 192, 64, 256

    assert attn.expanded_pays(1024, 1024) and attn.expanded_pays(2048, 4096)
    assert not attn.expanded_pays(1, 4096) and not attn.expanded_pays(16, 1024)
    # a pair costs 512 multiply-adds expanded vs 1,088 absorbed: the mask path may cover ~1.06x the context
    assert 1.0 < attn.expanded_mask_gain() < 1.1
