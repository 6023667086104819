"""Fitting an MTP layer (glm5_trainer.mtp): what is trained is what serves (the training module's draft logits
equal our engine's MTP layer loaded from the checkpoint written, 1e-4, on shapes that are not round numbers), and
a short fit on patterned traces learns (its loss falls, its drafts match on traces it did not train on)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from glm5.errors import ConfigError
from glm5.model.loader import load_model
from glm5.tokenizer.build import write_tokenizer
from glm5_trainer.mtp import MTPFit, Trace, fit, save

from tests.helpers.oracle import SimpleRunner, hf_checkpoint

pytestmark = pytest.mark.oracle

# hidden 72 and expert width 40: not multiples of the kernels' tiles; the last decoder layer a MoE one
SHAPES = dict(vocab_size=1024, hidden_size=72, moe_intermediate_size=40, intermediate_size=104, index_topk=16,
              num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
              indexer_types=["full"] * 3)  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mtp-base")
    hf_checkpoint(path, seed=11, **SHAPES)
    write_tokenizer(path)
    return path


def test_the_fitted_layer_serves_as_it_was_trained(base: Path, tmp_path: Path) -> None:
    layer = MTPFit(base, tmp_path / "block")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # as if trained: every trained tensor away from its initial value
        for p in layer.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    save(base, tmp_path / "out", layer)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3
    served = load_model(tmp_path / "out", mtp="require")
    assert len(served.mtp_layers) == 1
    ids = torch.randint(0, 1024, (53,), generator=g)
    runner = SimpleRunner(served, 64)
    hidden = runner.prefill_hidden(ids)
    got = torch.log_softmax(runner.mtp(ids[1:], hidden[:-1], 0), dim=-1)
    with torch.no_grad():
        logits, _ = layer.eval()(ids[None, 1:], hidden[None, :-1], torch.arange(52)[None], torch.ones(1, 52))
    want = torch.log_softmax(logits[0], dim=-1)
    assert (got - want).abs().max().item() <= 1e-4
    # the decoder layers are the base's, unchanged
    plain = SimpleRunner(load_model(base), 64).prefill(ids)
    assert torch.equal(SimpleRunner(load_model(tmp_path / "out"), 64).prefill(ids), plain)


def _traces(n: int, seed: int) -> list[Trace]:
    """Contexts of random tokens, continued by counting up in steps of 3 from the context's last token: the
    token two ahead follows from the next one, which the MTP layer reads."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        context = [rng.randrange(100, 130) for _ in range(rng.randint(5, 20))]
        generated = [100 + (context[-1] - 100 + 3 * (i + 1)) % 30 for i in range(rng.randint(8, 24))]
        out.append(Trace(context, generated))
    return out


def test_a_short_fit_learns_its_traces_and_writes_a_servable_checkpoint(base: Path, tmp_path: Path) -> None:
    record = fit(base, tmp_path / "fitted", _traces(96, seed=1), steps=60, batch=16, lr=3e-3, depth=2,
                 held_out=0.2, seed=0)  # fmt: skip
    assert record["final_loss"] < 0.5 * record["initial_loss"]
    assert record["held_out_traces"] == 19 and len(record["held_out_accuracy_by_depth"]) == 2
    assert record["held_out_accuracy_by_depth"][0] > 0.5  # chance: 1 in 30 of the counting tokens
    assert len(load_model(tmp_path / "fitted", mtp="require").mtp_layers) == 1
    assert not (tmp_path / "fitted.block").exists()
    with pytest.raises(ConfigError, match="already has MTP layers"):
        fit(tmp_path / "fitted", tmp_path / "again", _traces(8, seed=2), steps=1)
