"""Compiled decode steps (glm5_worker.engine.compiled) give the eager engine's greedy tokens, and really run.

Compiling is slow on 2 cores (tens of seconds per graph, cold), so the suite runs eagerly (GLM5_ENFORCE_EAGER=1,
tests/conftest.py) and only these tests compile: two of the transformers parity configurations (top-k 12,
blocks of 16: every context past the first block is "long") and the tiny preset (top-k 256, blocks of 64: short
contexts get their own graph).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from glm5.model.loader import load_model
from glm5.model.presets import init_model
from glm5.tokenizer.build import write_tokenizer
from glm5_worker.config import EngineConfig
from glm5_worker.engine.compiled import Shape, unavailable
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from tests.helpers.oracle import hf_checkpoint

PARITY = {
    "grouped-moe": dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, index_topk=12),
    "shared-indexer": dict(num_hidden_layers=4, index_topk_pattern="FSFS", index_topk=12),
}


def engine(path: Path, eager: bool, cache: Path, **kw: object) -> Engine:
    base = dict(model=str(path), max_model_len=1024, kv_cache_bytes=16 << 20, block_size=16, kv_int8_tier=False,
                dense_warmup_tokens=0, max_num_batched_tokens=128, enforce_eager=eager, compile_max_batch=4,
                compile_cache_dir=str(cache))  # fmt: skip
    return Engine(EngineConfig(**{**base, **kw}))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One inductor cache for the tests of one model's shapes: a graph another test compiled is read back, not
    rebuilt (the disk cache's own test keeps a directory of its own)."""
    return tmp_path_factory.mktemp("compile-cache")


def generate(eng: Engine, prompts: list[list[int]], new: int, together: bool) -> list[list[int]]:
    """Greedy tokens of each prompt: one at a time (batch-1 steps) or all at once (batched steps)."""
    out: dict[str, list[int]] = {}
    groups = [list(enumerate(prompts))] if together else [[(i, p)] for i, p in enumerate(prompts)]
    for group in groups:
        for i, p in group:
            eng.add_request(f"r{i}", None, p, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True))
        while eng.has_work:
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(20, 1000, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("config", list(PARITY))
def test_compiled_decode_matches_eager_on_parity_configs(config: str, tmp_path: Path, cache: Path) -> None:
    hf_checkpoint(tmp_path / "m", seed=3, vocab_size=1024, **PARITY[config])
    write_tokenizer(tmp_path / "m")
    eager = engine(tmp_path / "m", True, cache)
    compiled = engine(tmp_path / "m", False, cache)
    runner = compiled.runner.compiled
    assert runner is not None and eager.runner.compiled is None
    # blocks of 16 and top-k 12: every context is long; batch 1 and batches of 2..4 each have a graph
    assert runner.ready == {Shape(single=True, long=True), Shape(single=False, long=True)}
    # each shape's function holds its one graph: a step checks one graph's guards, not every shape's in turn
    for shape in runner.ready:
        code = runner._fns[shape]._torchdynamo_orig_callable.__code__  # type: ignore[attr-defined]
        assert len(_debug_get_cache_entry_list(code)) == 1, shape
    ps = prompts([5, 40, 70], seed=1)
    for together in (False, True):
        want = generate(eager, ps, 24, together)
        got = generate(compiled, ps, 24, together)
        assert got == want, f"together={together}"
    # every decode step ran compiled (3 x 23 of one sequence, 23 of three), nothing fell back to eager, and the
    # attention entropy the engine samples every 8th step was measured inside the graph, as eagerly
    assert runner.steps == 3 * 23 + 23 and runner.fallbacks == 0
    for mine, theirs in zip(compiled.sparsity.layers, eager.sparsity.layers, strict=True):
        assert mine.entropy_short is not None and mine.entropy_short == pytest.approx(theirs.entropy_short, rel=1e-4)


def test_compiled_decode_reads_the_int8_tier(tmp_path: Path, cache: Path) -> None:
    """Tokens older than l1_tokens move to the INT8 tier: a compiled step reads both tiers inside its graph (the
    eager split by tier broke the graph, and its pieces recompiled, and failed, while serving)."""
    hf_checkpoint(tmp_path / "m", seed=3, vocab_size=1024, **PARITY["shared-indexer"])
    write_tokenizer(tmp_path / "m")
    eager = engine(tmp_path / "m", True, cache, kv_int8_tier=True, l1_tokens=32)
    compiled = engine(tmp_path / "m", False, cache, kv_int8_tier=True, l1_tokens=32)
    demoted: list[tuple[int, int]] = []
    demote = compiled.runner.demote
    compiled.runner.demote = lambda copies: (demoted.extend(copies), demote(copies))[1]  # type: ignore[method-assign]
    ps = prompts([70, 100], seed=2)
    for together in (False, True):
        assert generate(compiled, ps, 24, together) == generate(eager, ps, 24, together), f"together={together}"
    runner = compiled.runner.compiled
    assert runner is not None and runner.steps == 2 * 23 + 23 and runner.fallbacks == 0
    assert demoted  # the steps did read blocks from the INT8 tier


def test_compiled_steps_read_swapped_weights(tmp_path: Path, cache: Path) -> None:
    """RL copies new weights into the live tensors between steps: the compiled graphs must read them (parameters
    are graph inputs, never constants folded in at compile time)."""
    for name, seed in (("a", 3), ("b", 4)):
        hf_checkpoint(tmp_path / name, seed=seed, vocab_size=1024, **PARITY["shared-indexer"])
        write_tokenizer(tmp_path / name)
    eager = engine(tmp_path / "a", True, cache)
    compiled = engine(tmp_path / "a", False, cache, compile_max_batch=1)
    ps = prompts([40], seed=5)
    before = generate(compiled, ps, 16, together=False)
    assert before == generate(eager, ps, 16, together=False)
    for eng in (eager, compiled):
        eng.swap_weights(load_model(tmp_path / "b"), version=1)
    after = generate(compiled, ps, 16, together=False)
    assert after != before, "the new weights changed nothing: the test cannot tell"
    assert after == generate(eager, ps, 16, together=False)
    assert compiled.runner.compiled is not None and compiled.runner.compiled.fallbacks == 0


def test_short_and_long_contexts_and_the_disk_cache(tmp_path: Path) -> None:
    """The tiny preset (top-k 256, blocks of 64): contexts up to 256 tokens pick every token (their own graph),
    longer ones run the indexer. A second engine on the same cache directory reuses the compiled graphs."""
    from torch._dynamo.utils import counters

    path = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    kw = dict(block_size=64, compile_max_batch=1)
    torch._dynamo.reset()  # start as a fresh process does (a cached graph's key depends on dynamo's state)
    eager = engine(path, True, tmp_path / "cache", **kw)
    compiled = engine(path, False, tmp_path / "cache", **kw)
    runner = compiled.runner.compiled
    assert runner is not None and runner.ready == {Shape(True, True), Shape(True, False)}
    ps = prompts([30, 300], seed=2)  # short, and past top-k
    want = generate(eager, ps, 40, together=False)
    assert generate(compiled, ps, 40, together=False) == want
    assert runner.steps == 2 * 39 and runner.fallbacks == 0
    # two sequences at once: larger than compile_max_batch, so those steps run eagerly (same tokens)
    assert generate(compiled, ps, 10, together=True) == generate(eager, ps, 10, together=True)
    assert any((tmp_path / "cache").rglob("*.py")), "inductor wrote no generated code into the cache directory"
    # a new start: dynamo forgets its graphs (as a new process would); the compiled ones come from the disk cache
    torch._dynamo.reset()
    hits = counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
    again = engine(path, False, tmp_path / "cache", **kw)
    assert again.runner.compiled is not None and again.runner.compiled.ready == runner.ready
    now = counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
    assert now >= hits + 2, "the second start compiled its graphs again instead of reading them from the cache"
    assert generate(again, ps[:1], 10, together=False)[0] == want[0][:10]


def test_what_cannot_be_compiled_runs_eagerly(tmp_path: Path) -> None:
    path = init_model(tmp_path / "tiny", preset="tiny-shallow", seed=0)
    eng = engine(path, False, tmp_path / "cache", dense_warmup_tokens=512)  # wider than top-k (256)
    assert eng.runner.compiled is None
    assert unavailable(eng.runner) == "compiled decode steps need --dense-warmup-tokens <= the model's index_topk"
    with pytest.raises(Exception, match="compile-max-batch"):
        EngineConfig(compile_max_batch=0)
