"""Compiled decode steps (glm5_worker.runner.compiled) give the eager engine's greedy tokens, and really run.

Compiling is slow on 2 cores (tens of seconds per graph, cold), so the suite runs eagerly (GLM5_ENFORCE_EAGER=1,
tests/conftest.py) and only these tests compile: two of the transformers parity configurations (top-k 12,
blocks of 16: every context past the first block is "long"), one of them with the INT8 tier. The tiny preset's
short-context graph, the disk cache and steps wider than --compile-max-batch are checked through `glm5 worker`
(tests/integration/test_background_compile.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from glm5.model.loader import load_model
from glm5.model.presets import init_model
from glm5.tokenizer.build import write_tokenizer
from glm5_worker.config import EngineConfig, SpeculativeConfig
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams
from glm5_worker.runner.compiled import Shape, unavailable
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from tests.helpers.oracle import hf_checkpoint, mtp_checkpoint

PARITY = {
    "grouped-moe": dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, index_topk=12),
    "shared-indexer": dict(num_hidden_layers=4, index_topk_pattern="FSFS", index_topk=12),
}
# Engine settings per configuration. Shared-indexer: tokens older than l1_tokens move to the INT8 tier, so its
# graphs read both tiers (the eager split by tier broke the graph, and its pieces recompiled, and failed, while
# serving), batch 1 and batches of 2..4. Grouped-moe: the float tier, and batch 1 only (its routing is the same
# code in both graphs; one graph fewer to compile, ~35 s here).
SETTINGS: dict[str, dict[str, object]] = {
    "grouped-moe": dict(compile_max_batch=1),
    "shared-indexer": dict(kv_int8_tier=True, l1_tokens=32),
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
    eager = engine(tmp_path / "m", True, cache, **SETTINGS[config])
    compiled = engine(tmp_path / "m", False, cache, **SETTINGS[config])
    demoted: list[tuple[int, int]] = []
    demote = compiled.runner.demote
    compiled.runner.demote = lambda copies: (demoted.extend(copies), demote(copies))[1]  # type: ignore[method-assign]
    runner = compiled.runner.compiled
    assert runner is not None and eager.runner.compiled is None
    # blocks of 16 and top-k 12: every context is long; batch 1 and batches of 2..4 each have a graph
    batched = runner.max_batch > 1
    assert runner.ready == {Shape(single=True, long=True), Shape(single=False, long=True)} - (
        set() if batched else {Shape(single=False, long=True)}
    )
    # each shape's function holds its one graph: a step checks one graph's guards, not every shape's in turn
    for shape in runner.ready:
        code = runner._fns[shape]._torchdynamo_orig_callable.__code__  # type: ignore[attr-defined]
        assert len(_debug_get_cache_entry_list(code)) == 1, shape
    ps = prompts([5, 40, 70], seed=1)
    for together in (False, True):
        want = generate(eager, ps, 24, together)
        got = generate(compiled, ps, 24, together)
        assert got == want, f"together={together}"
    # every decode step ran compiled (3 x 23 of one sequence, 23 of three where batches have a graph; wider
    # steps run eagerly), nothing fell back to eager, and the attention entropy the engine samples every 8th
    # step was measured inside the graph, as eagerly
    assert runner.steps == 3 * 23 + (23 if batched else 0) and runner.fallbacks == 0
    for mine, theirs in zip(compiled.sparsity.layers, eager.sparsity.layers, strict=True):
        assert mine.entropy_short is not None and mine.entropy_short == pytest.approx(theirs.entropy_short, rel=1e-4)
    assert bool(demoted) == ("kv_int8_tier" in SETTINGS[config]), "the steps read no block from the INT8 tier"


def test_compiled_steps_read_swapped_weights(tmp_path: Path, cache: Path) -> None:
    """RL copies new weights into the live tensors between steps: the compiled graphs must read them (parameters
    are graph inputs, never constants folded in at compile time)."""
    for name, seed in (("a", 3), ("b", 4)):
        hf_checkpoint(tmp_path / name, seed=seed, vocab_size=1024, **PARITY["shared-indexer"])
        write_tokenizer(tmp_path / name)
    # the shared-indexer settings of the parity test: its batch-1 graph is read from the module's cache
    eager = engine(tmp_path / "a", True, cache, **SETTINGS["shared-indexer"])
    compiled = engine(tmp_path / "a", False, cache, compile_max_batch=1, **SETTINGS["shared-indexer"])
    ps = prompts([40], seed=5)
    before = generate(compiled, ps, 16, together=False)
    assert before == generate(eager, ps, 16, together=False)
    for eng in (eager, compiled):
        eng.swap_weights(load_model(tmp_path / "b"), version=1)
    after = generate(compiled, ps, 16, together=False)
    assert after != before, "the new weights changed nothing: the test cannot tell"
    assert after == generate(eager, ps, 16, together=False)
    assert compiled.runner.compiled is not None and compiled.runner.compiled.fallbacks == 0


def test_compiled_verify_steps(tmp_path: Path, cache: Path) -> None:
    """Speculative decoding: a sequence and its drafts are decode rows of one step, so the verify steps run the
    batched decode graph (the shared-indexer settings of the parity test: its graphs come from the module's
    cache), with the eager engine's greedy tokens without speculation. Prompt lookup (ngram) drafts here; the MTP
    layer's own graphs are the next test's."""
    hf_checkpoint(tmp_path / "m", seed=3, vocab_size=1024, **PARITY["shared-indexer"])
    write_tokenizer(tmp_path / "m")
    settings = SETTINGS["shared-indexer"]
    eager = engine(tmp_path / "m", True, cache, **settings)
    spec = SpeculativeConfig("ngram", 3)
    compiled = engine(tmp_path / "m", False, cache, speculative=spec, **settings)
    runner = compiled.runner.compiled
    assert runner is not None and runner.ready == {Shape(True, True), Shape(False, True)}
    # prompts that hold many of the vocabulary's tokens: a token the model emits has often occurred before
    ps = [list(range(40, 240)), prompts([120], seed=4)[0] * 2]
    for together in (False, True):
        assert generate(compiled, ps, 24, together) == generate(eager, ps, 24, together), f"together={together}"
    counters = compiled.stats().speculative
    assert counters is not None and counters.steps > 0 and counters.drafted >= counters.steps
    assert runner.fallbacks == 0 and runner.steps > 0


def test_compiled_verify_steps_and_mtp_passes(tmp_path: Path) -> None:
    """Speculative decoding with the MTP layer: a sequence's verify rows run through the decode graphs (the batch
    graph for one sequence and its drafts) and the MTP layer's decode passes through graphs of their own
    (CompiledDecode.run_draft), with the eager engine's greedy tokens. Its graphs compile cold (~140 s here):
    nothing else in the suite checks the MTP passes compiled."""
    mtp_checkpoint(tmp_path / "m", 3, seed=3, vocab_size=1024, **PARITY["grouped-moe"])
    write_tokenizer(tmp_path / "m")
    spec = SpeculativeConfig("mtp", 2)
    eager = engine(tmp_path / "m", True, tmp_path / "cache", speculative=spec)
    compiled = engine(tmp_path / "m", False, tmp_path / "cache", speculative=spec)
    runner = compiled.runner.compiled
    assert runner is not None and runner.draft_ready == runner.ready == {Shape(True, True), Shape(False, True)}
    ps = prompts([5, 40], seed=1)
    for together in (False, True):
        assert generate(compiled, ps, 20, together) == generate(eager, ps, 20, together), f"together={together}"
    # every verify step and every MTP pass but those after a prefill (their rows are a chunk) ran compiled
    assert runner.fallbacks == 0 and runner.steps > 0 and runner.draft_steps >= 2 * runner.steps - 3
    c = compiled.stats().speculative
    assert c is not None and c.drafted > 0


def test_what_cannot_be_compiled_runs_eagerly(tmp_path: Path) -> None:
    path = init_model(tmp_path / "tiny", preset="tiny-shallow", seed=0)
    eng = engine(path, False, tmp_path / "cache", dense_warmup_tokens=512)  # wider than top-k (256)
    assert eng.runner.compiled is None
    assert unavailable(eng.runner) == "compiled decode steps need --dense-warmup-tokens <= the model's index_topk"
    with pytest.raises(Exception, match="compile-max-batch"):
        EngineConfig(compile_max_batch=0)
