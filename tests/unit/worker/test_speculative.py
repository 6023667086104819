"""Speculative decoding (glm5_worker.engine.speculative): the acceptance rule keeps the target's distribution
(chi-square, and a mutated rule fails the same test), and the engine's tokens and log-probs with drafts (MTP
layer, k = 1 and 3; prompt lookup) equal those without, through chunked prefill, prefix-cache hits, a
preemption, stop rules inside an accepted run, and requests that may not speculate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from glm5.errors import CheckpointError, ConfigError
from glm5.tokenizer.build import write_tokenizer
from glm5_worker.config import EngineConfig, SpeculativeConfig
from glm5_worker.engine.engine import Engine, RequestOutput
from glm5_worker.engine.sampler import Sampler
from glm5_worker.engine.sequence import FinishReason, SamplingParams, Sequence
from glm5_worker.engine.speculative import ngram_drafts, verify
from safetensors.torch import load_file, save_file

from tests.helpers.oracle import mtp_checkpoint
from tests.unit.worker.test_engine import prompts, tokens

# hidden 72 and expert width 40: not multiples of the kernels' tiles; 3 decoder layers and an MTP layer
LAYERS = 3
SHAPES = dict(vocab_size=1024, hidden_size=72, moe_intermediate_size=40, intermediate_size=104, index_topk=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec-ckpt")
    mtp_checkpoint(path, LAYERS, seed=3, **SHAPES)
    write_tokenizer(path)
    return path


def make_engine(path: Path, spec: SpeculativeConfig | None, **kw: object) -> Engine:
    base = dict(model=str(path), max_model_len=512, kv_cache_bytes=16 << 20, block_size=16, dense_warmup_tokens=0,
                kv_int8_tier=False, max_num_batched_tokens=48, speculative=spec)  # fmt: skip
    return Engine(EngineConfig(**{**base, **kw}))  # type: ignore[arg-type]


def run(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(5000):
        if not engine.has_work:
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("the engine did not finish")


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


def serve(engine: Engine, ps: list[list[int]], params: SamplingParams) -> dict[str, list[RequestOutput]]:
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", None, p, params)
    return run(engine)


# configuration ------------------------------------------------------------------------------------------------
def test_speculative_config_takes_vllms_flag() -> None:
    spec = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 8}')
    assert spec == SpeculativeConfig("mtp", 3, 8)
    assert SpeculativeConfig.parse(spec.flag()) == spec
    # without disable_by_batch_size a CPU worker drafts only at batch 1 (where it pays here); an accelerator
    # always, and an explicit null means always on a CPU too
    assert SpeculativeConfig.parse('{"method": "deepseek_mtp"}') == SpeculativeConfig("mtp", 1, 1)
    assert SpeculativeConfig.parse('{"method": "deepseek_mtp"}', "cuda") == SpeculativeConfig("mtp", 1)
    assert SpeculativeConfig.parse('{"disable_by_batch_size": null}') == SpeculativeConfig("mtp", 1)
    for off in (None, "", "none", "None", "off"):
        assert SpeculativeConfig.parse(off) is None
    bad = {
        "[1]": "JSON object",
        "{": "JSON object or none",
        '{"method": "eagle"}': "method must be one of",
        '{"num_speculative_tokens": 0}': "1..8",
        '{"num_speculative_tokens": "3"}': "1..8",
        '{"disable_by_batch_size": 0}': "disable_by_batch_size",
        '{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}': "prompt_lookup_min",
        '{"k": 3}': "unknown keys k",
    }
    for text, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.parse(text)
    EngineConfig(tensor_parallel_size=2, speculative=spec)  # a replica speculates too (the TP test below)


def test_mtp_needs_a_checkpoint_with_mtp_weights(tiny_model: Path, checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no multi-token-prediction layers"):
        make_engine(tiny_model, SpeculativeConfig("mtp", 2))
    make_engine(tiny_model, SpeculativeConfig("ngram", 2))  # needs no weights
    # a checkpoint that declares its MTP layer but lost its weights ("without mtp" quantizations)
    lost = tmp_path / "lost"
    lost.mkdir()
    for f in checkpoint.iterdir():
        (lost / f.name).write_bytes(f.read_bytes())
    tensors = {k: v for k, v in load_file(lost / "model.safetensors").items() if ".layers.3." not in k}
    save_file(tensors, lost / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((lost / "config.json").read_text())["num_nextn_predict_layers"] == 1
    make_engine(lost, None)  # serves without speculation
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.eh_proj\.weight"):
        make_engine(lost, SpeculativeConfig("mtp", 1))


def test_auto_drafts_with_a_stored_mtp_layer_on_an_accelerator(tiny_model: Path, checkpoint: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    from glm5.model.config import ModelConfig
    from glm5_worker.resolved import auto_speculation

    auto = SpeculativeConfig.parse("auto", "cpu")
    assert auto is not None and auto.method == "auto" and auto.num_speculative_tokens == 3
    cuda = SpeculativeConfig.parse("auto", "cuda")
    assert auto.disable_by_batch_size == 1 and cuda is not None and cuda.disable_by_batch_size is None
    assert SpeculativeConfig.parse('{"method": "auto", "num_speculative_tokens": 2}').num_speculative_tokens == 2

    def decide(path: Path, spec: SpeculativeConfig, device: str) -> SpeculativeConfig | None:
        return auto_speculation(EngineConfig(model=str(path), speculative=spec), ModelConfig.from_file(path), path,
                                device)  # fmt: skip

    # the checkpoint stores its MTP layer: an accelerator drafts with it (under tensor parallelism too)
    assert decide(checkpoint, cuda, "cuda") == SpeculativeConfig("mtp", 3)
    # a CPU does not (speculation cost it tokens/s): the engine there resolves to none and loads no MTP layer
    with caplog.at_level("INFO", logger="glm5_worker.resolved"):
        eng = make_engine(checkpoint, auto)
    assert eng.spec is None and eng.runner.model.mtp_layers == [] and eng.resolved.engine.speculative is None
    assert any("auto on a CPU" in r.getMessage() for r in caplog.records)
    # no MTP layer declared, or declared and not stored: off, the second with a warning
    assert decide(tiny_model, cuda, "cuda") is None
    lost = tmp_path / "lost"
    lost.mkdir()
    for f in checkpoint.iterdir():
        (lost / f.name).write_bytes(f.read_bytes())
    save_file({k: v for k, v in load_file(lost / "model.safetensors").items() if ".layers.3." not in k},
              lost / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    with caplog.at_level("WARNING", logger="glm5_worker.resolved"):
        assert decide(lost, cuda, "cuda") is None
    assert any("does not store them all" in r.getMessage() for r in caplog.records)


def test_a_weight_update_without_the_mtp_layer_keeps_the_served_one(checkpoint: Path, tmp_path: Path) -> None:
    """A trainer's policy carries the model, not its drafter: the update replaces the decoder layers and leaves
    the MTP layer; an update that carries an MTP layer replaces it too."""
    from glm5_worker.runner.weights import read_checkpoint, swap_in_place

    eng = make_engine(checkpoint, SpeculativeConfig("mtp", 2))
    live = eng.runner.model
    mtp_before = {k: v.clone() for k, v in live.model.layers[3].state_dict().items()}
    policy = tmp_path / "policy"
    policy.mkdir()
    for f in checkpoint.iterdir():
        (policy / f.name).write_bytes(f.read_bytes())
    tensors = {k: (v * 1.01 if k == "model.norm.weight" else v)
               for k, v in load_file(checkpoint / "model.safetensors").items() if ".layers.3." not in k}  # fmt: skip
    save_file(tensors, policy / "model.safetensors", metadata={"format": "pt"})
    fp = eng.tokenizer.fingerprint
    new = read_checkpoint(str(policy), eng.model_config, eng.dtype, eng.device, fp, mtp="stored")
    assert new.mtp_layers == []
    swap_in_place(live, new)
    assert torch.equal(live.model.norm.weight, tensors["model.norm.weight"])
    assert all(torch.equal(v, mtp_before[k]) for k, v in live.model.layers[3].state_dict().items())
    # one that carries the layer replaces it
    full = load_file(checkpoint / "model.safetensors")
    full["model.layers.3.eh_proj.weight"] = full["model.layers.3.eh_proj.weight"] * 2
    save_file(full, policy / "model.safetensors", metadata={"format": "pt"})
    swap_in_place(live, read_checkpoint(str(policy), eng.model_config, eng.dtype, eng.device, fp, mtp="stored"))
    assert torch.equal(live.model.layers[3].eh_proj.weight, full["model.layers.3.eh_proj.weight"])
    # and the engine still decodes (drafting with the swapped layer)
    assert len(serve(eng, prompts(1, seed=4), greedy(8))["r0"][-1].token_ids) > 0


# the acceptance rule ------------------------------------------------------------------------------------------
def _chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def _sampled(seed: int) -> Sequence:
    seq = Sequence("s", [1], SamplingParams(temperature=0.8, top_k=5), detokenizer=None)  # type: ignore[arg-type]
    seq.generator = torch.Generator().manual_seed(seed)
    return seq


@pytest.mark.parametrize("one_hot", [False, True], ids=["drafts-with-q", "drafts-one-hot"])
def test_verify_keeps_the_target_distribution(one_hot: bool) -> None:
    """Each emitted token, given what came before it, is distributed as the target says (the rows' logits do not
    depend on the prefix here, so the first and second emitted tokens must follow rows 0 and 1); the same test
    fails the rule fed another proposal distribution than the one the drafts were drawn from. (Treating a drawn
    draft as one-hot would not fail it: accepting with p(d) and else drawing from p without d is exact too.)"""
    vocab, n = 7, 6000
    g = torch.Generator().manual_seed(0)
    target = torch.randn(3, vocab, generator=g) * 1.5  # two drafts: rows 0..2
    proposer = torch.randn(2, vocab, generator=g) * 1.5
    sampler = Sampler(0, torch.device("cpu"))
    seq = _sampled(1)
    p = sampler.filtered_probs(target, [seq] * 3)
    q = sampler.filtered_probs(proposer, [seq] * 2)
    uniform = torch.where(q[0] > 0, 1.0, 0.0) / (q[0] > 0).sum()
    draw = torch.Generator().manual_seed(2)

    def counts(mutated: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
        first, second = torch.zeros(vocab), torch.zeros(vocab)
        accepted = 0
        for _ in range(n):
            if one_hot:  # prompt lookup: the same drafts every time, no distribution
                drafts, qs = [int(p[0].argmax()), int(p[1].argmin())], [None, None]
            else:
                drafts = [int(torch.multinomial(q[i], 1, generator=draw)) for i in range(2)]
                qs = [uniform, uniform] if mutated else [q[0], q[1]]
            picks, a = verify(target, drafts, qs, seq, sampler)  # type: ignore[arg-type]
            accepted += a
            first[picks[0].token_id] += 1
            if len(picks) > 1:
                second[picks[1].token_id] += 1
        return first, second, accepted / (2 * n)

    first, second, rate = counts(mutated=False)
    assert 0.05 < rate < 0.95
    assert _chi2_p_value(first, p[0]) > 1e-3
    assert _chi2_p_value(second, p[1]) > 1e-3
    if not one_hot:
        first, second, _ = counts(mutated=True)
        assert min(_chi2_p_value(first, p[0]), _chi2_p_value(second, p[1])) < 1e-6


def test_verify_under_an_output_format_keeps_the_masked_distribution() -> None:
    """A sampled request under an output format: drafts drawn from a proposer that ignores the format (so some are
    tokens the format refuses) and rows masked as the format stands. Each emitted token follows the masked target
    and a refused token is never emitted; deciding on the unmasked rows (the mutation) emits refused tokens."""
    vocab, n = 7, 4000
    g = torch.Generator().manual_seed(3)
    target = torch.randn(3, vocab, generator=g) * 1.5
    proposer = torch.randn(2, vocab, generator=g) * 1.5
    sampler = Sampler(0, torch.device("cpu"))
    seq = _sampled(4)
    q = sampler.filtered_probs(proposer, [seq] * 2)
    masked = target.clone()
    refused = [int(q[0].argmax()), int(q[1].argmax())]  # the proposer's likeliest token, refused at its row
    for row, token in enumerate(refused):
        masked[row, token] = float("-inf")
    p = sampler.filtered_probs(masked, [seq] * 3)
    draw = torch.Generator().manual_seed(5)

    def counts(constrained: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        first, second = torch.zeros(vocab), torch.zeros(vocab)
        for _ in range(n):
            drafts = [int(torch.multinomial(q[i], 1, generator=draw)) for i in range(2)]
            picks, _ = verify(target, drafts, [q[0], q[1]], seq, sampler, constrained)
            first[picks[0].token_id] += 1
            if len(picks) > 1:
                second[picks[1].token_id] += 1
        return first, second

    first, second = counts(masked)
    assert first[refused[0]] == 0 and second[refused[1]] == 0 and second.sum() > n / 10
    assert _chi2_p_value(first, p[0]) > 1e-3 and _chi2_p_value(second, p[1]) > 1e-3
    first, second = counts(None)
    assert first[refused[0]] + second[refused[1]] > n / 20


def test_greedy_verify_keeps_the_longest_matching_prefix() -> None:
    sampler = Sampler(0, torch.device("cpu"))
    seq = Sequence("g", [1], greedy(8, logprobs=True), detokenizer=None)  # type: ignore[arg-type]
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([3, 4, 5, 6]):
        logits[row, token] = 5.0
    for drafts, want in (([3, 4, 5], [3, 4, 5, 6]), ([3, 9, 5], [3, 4]), ([1, 4, 5], [3]), ([3, 4], [3, 4, 5])):
        picks, accepted = verify(logits[: len(drafts) + 1], drafts, [None] * len(drafts), seq, sampler)
        assert [p.token_id for p in picks] == want and accepted == len(want) - 1
        lp = torch.log_softmax(logits, dim=-1)
        assert [p.logprob for p in picks] == pytest.approx([float(lp[i, t]) for i, t in enumerate(want)])


def test_ngram_drafts_follow_the_latest_match() -> None:
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2, 3, 1) == [7, 8]
    assert ngram_drafts([5, 6, 5, 6, 5], 3, 4, 1) == [6, 5]
    assert ngram_drafts([1, 2, 3, 4], 3, 4, 2) == []
    assert ngram_drafts([4, 1, 2, 4], 2, 1, 1) == [1, 2]


# the engine ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec", [SpeculativeConfig("mtp", 1), SpeculativeConfig("mtp", 3), SpeculativeConfig("ngram", 3)],
    ids=["mtp-k1", "mtp-k3", "ngram-k3"],
)  # fmt: skip
def test_greedy_tokens_and_logprobs_equal_those_without_speculation(checkpoint: Path,
                                                                    spec: SpeculativeConfig) -> None:  # fmt: skip
    ps = prompts(3, seed=4)
    ps.append(ps[1] + [7, 8, 9])  # a prefix-cache hit on ps[1]'s blocks
    params = greedy(30, logprobs=True, top_logprobs=2)
    base = serve(make_engine(checkpoint, None), ps, params)
    engine = make_engine(checkpoint, spec)
    got = serve(engine, ps, params)
    assert engine.blocks.prefix_hits > 0
    for rid, outs in base.items():
        assert tokens(got[rid]) == tokens(outs), rid
        want = [lp for o in outs for lp in o.logprobs]
        have = [lp for o in got[rid] for lp in o.logprobs]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(want, have, strict=True)) <= 1e-4
        assert [[t for t, _ in a.top] for a in want] == [[t for t, _ in b.top] for b in have]
    c = engine.stats().speculative
    assert c is not None and c.drafted >= c.accepted >= 0 and c.steps > 0
    assert c.by_position == sorted(c.by_position, reverse=True) and sum(c.by_position) == c.accepted


def test_a_block_fp8_checkpoint_speculates_with_the_tokens_it_gives_without(checkpoint: Path, tmp_path: Path) -> None:
    """GLM-5-FP8's format (16 x 16 blocks here: partial along hidden 72 and experts 40), the MTP layer quantized
    too: the greedy tokens and log-probs of the same checkpoint without speculation, and drafts accepted."""
    from dataclasses import replace

    from glm5.quantize.quantizer import quantize_checkpoint
    from glm5.quantize.recipe import load_recipe

    fp8 = tmp_path / "fp8"
    quantize_checkpoint(checkpoint, fp8, replace(load_recipe("fp8-block", None), block_size=(16, 16)),
                        progress=False, log=lambda _: None)  # fmt: skip
    assert any(n.startswith(f"model.layers.{LAYERS}.") and t.dtype == torch.float8_e4m3fn
               for n, t in load_file(fp8 / "model.safetensors").items())  # fmt: skip
    ps, params = prompts(2, seed=9), greedy(24, logprobs=True)
    base = serve(make_engine(fp8, None), ps, params)
    engine = make_engine(fp8, SpeculativeConfig("mtp", 2))
    got = serve(engine, ps, params)
    for rid, outs in base.items():
        assert tokens(got[rid]) == tokens(outs), rid
        want = [lp.logprob for o in outs for lp in o.logprobs]
        assert [lp.logprob for o in got[rid] for lp in o.logprobs] == pytest.approx(want, abs=1e-4)
    assert engine.stats().speculative.drafted > 0  # type: ignore[union-attr]


def test_preemption_and_stop_rules_inside_an_accepted_run(tiny_model: Path) -> None:
    """On the tiny preset, whose random outputs repeat, so that prompt lookup's drafts are often accepted."""
    checkpoint = tiny_model
    spec = SpeculativeConfig("ngram", 3)
    ps = prompts(3, seed=15)
    # room for ~16 blocks of 16 tokens: three sequences of ~100 tokens cannot all stay resident
    engine = make_engine(checkpoint, None)
    per_token = engine.pool_plan.fp_bytes_per_token
    base = serve(engine, ps, greedy(60))
    engine = make_engine(checkpoint, spec, kv_cache_bytes=per_token * 16 * 16, max_model_len=160)
    got = serve(engine, ps, greedy(60))
    assert engine.scheduler.num_preemptions > 0 and engine.stats().speculative.accepted > 0  # type: ignore[union-attr]
    assert {k: tokens(v) for k, v in got.items()} == {k: tokens(v) for k, v in base.items()}
    # stop rules land where they would without speculation, even inside a run of accepted drafts
    gen = tokens(base["r0"])
    text = "".join(o.text for o in base["r0"])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    for params in (greedy(60, stop=[stop]), greedy(60, stop_token_ids=[gen[40]]), greedy(37)):
        want = serve(make_engine(checkpoint, None), ps[:1], params)["r0"]
        have = serve(make_engine(checkpoint, spec), ps[:1], params)["r0"]
        assert tokens(have) == tokens(want) and "".join(o.text for o in have) == "".join(o.text for o in want)
        assert (have[-1].finish_reason, have[-1].stop_reason) == (want[-1].finish_reason, want[-1].stop_reason)
        assert have[-1].completion_tokens == len(tokens(want))
    assert want[-1].finish_reason == FinishReason.LENGTH and len(tokens(want)) == 37


def test_above_disable_by_batch_size_nothing_drafts_and_no_mtp_pass_runs(checkpoint: Path) -> None:
    """Three requests at once with disable_by_batch_size 1: no drafts and no MTP pass while they run together
    (prefills count), and the one left alone does not draft either (its MTP rows have a gap); a request alone
    from the start drafts. Greedy tokens as without speculation."""
    ps = prompts(3, seed=31)
    spec = SpeculativeConfig("mtp", 2, disable_by_batch_size=1)
    lengths = [greedy(6), greedy(6), greedy(30)]
    engine = make_engine(checkpoint, spec, max_num_batched_tokens=512)  # all three admitted in the first step
    passes = 0
    real = engine._draft_pass

    def counted(*a: object) -> object:
        nonlocal passes
        passes += 1
        return real(*a)  # type: ignore[arg-type]

    engine._draft_pass = counted  # type: ignore[method-assign,assignment]
    for i, (p, params) in enumerate(zip(ps, lengths, strict=True)):
        engine.add_request(f"r{i}", None, p, params)
    got = run(engine)
    base = make_engine(checkpoint, None)
    for i, (p, params) in enumerate(zip(ps, lengths, strict=True)):
        base.add_request(f"r{i}", None, p, params)
    assert {k: tokens(v) for k, v in got.items()} == {k: tokens(v) for k, v in run(base).items()}
    assert passes == 0 and engine.stats().speculative.drafted == 0  # type: ignore[union-attr]
    serve(engine, ps[2:], greedy(20))
    assert passes > 0 and engine.stats().speculative.drafted > 0  # type: ignore[union-attr]


def test_requests_that_may_not_speculate_and_sampled_ones(checkpoint: Path) -> None:
    """Penalties and structured output decode a token per step (their rule depends on the tokens before), with
    the same tokens as without speculation; a seeded sampled request gives the same tokens on every run."""
    spec = SpeculativeConfig("mtp", 2)
    ps = prompts(2, seed=21)
    for params in (greedy(20, repetition_penalty=1.3), greedy(20, logit_bias={40: 3.0})):
        want = serve(make_engine(checkpoint, None), ps, params)
        engine = make_engine(checkpoint, spec)
        have = serve(engine, ps, params)
        assert {k: tokens(v) for k, v in have.items()} == {k: tokens(v) for k, v in want.items()}
        assert engine.stats().speculative.drafted == 0  # type: ignore[union-attr]
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_new_tokens=25, ignore_eos=True)
    runs = [tokens(serve(make_engine(checkpoint, spec), ps[:1], sampled)["r0"]) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 25


def test_structured_output_speculates_with_each_row_masked(checkpoint: Path) -> None:
    """Under an output format every verify row is masked as the format stands after the drafts before it: the
    same greedy tokens and log-probs as without speculation, drafts accepted inside the format (prompt lookup on a
    repetitive format) and across a thinking block's end (MTP drafts), and sampled outputs held to the format."""
    from glm5_worker.engine.structured import OutputFormat

    regex = r"\[(red|green|blue)(, (red|green|blue)){8}\]"
    prompt = prompts(1, seed=8)
    fmt = OutputFormat("regex", regex)
    plain = make_engine(checkpoint, None)
    free = tokens(serve(plain, prompt, greedy(12))["r0"])
    thinking = OutputFormat("regex", regex, think_close=free[4], starts_thinking=True)
    for spec, f in ((SpeculativeConfig("ngram", 3), fmt), (SpeculativeConfig("mtp", 2), thinking)):
        params = SamplingParams(temperature=0.0, max_new_tokens=120, output_format=f, logprobs=True)
        want = serve(make_engine(checkpoint, None), prompt, params)["r0"]
        engine = make_engine(checkpoint, spec)
        have = serve(engine, prompt, params)["r0"]
        assert tokens(have) == tokens(want) and have[-1].stop_reason == "structured_output"
        lp = [x.logprob for o in have for x in o.logprobs]
        assert lp == pytest.approx([x.logprob for o in want for x in o.logprobs], abs=1e-4)
        text = "".join(o.text for o in have)
        assert re.fullmatch(regex, text if f is fmt else engine.tokenizer.decode(tokens(have)[5:])), text
        stats = engine.stats().speculative
        assert stats is not None and stats.drafted > 0
        if spec.method == "ngram":
            assert stats.accepted > 0
    sampled = SamplingParams(temperature=1.0, seed=9, max_new_tokens=120, output_format=fmt)
    engine = make_engine(checkpoint, SpeculativeConfig("ngram", 3))
    runs = ["".join(o.text for o in serve(engine, prompt, sampled)["r0"]) for _ in range(2)]
    assert runs[0] == runs[1] and re.fullmatch(regex, runs[0]), runs[0]
    assert engine.stats().speculative.accepted > 0  # type: ignore[union-attr]


@pytest.mark.slow
def test_tensor_parallel_speculation_drafts_and_accepts_as_one_device(checkpoint: Path) -> None:
    """A replica of two ranks (gloo, a process each): the MTP passes run on both ranks' shards and give the drafts
    one device gives (the same counters), the tokens and log-probs are those without speculation; prompt lookup
    too, with drafts accepted."""
    ps = prompts(3, seed=31)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, logprobs=True)
    want = serve(make_engine(checkpoint, None), ps, params)
    for spec in (SpeculativeConfig("mtp", 2), SpeculativeConfig("ngram", 3)):
        one = make_engine(checkpoint, spec)
        one_out = serve(one, ps, params)
        replica = make_engine(checkpoint, spec, tensor_parallel_size=2)
        try:
            have = serve(replica, ps, params)
            counts = replica.stats().speculative
        finally:
            replica.close()
        for rid, outs in want.items():
            assert tokens(have[rid]) == tokens(outs) == tokens(one_out[rid])
            got = [x.logprob for o in have[rid] for x in o.logprobs]
            assert got == pytest.approx([x.logprob for o in outs for x in o.logprobs], abs=1e-4)
        mine = one.stats().speculative
        assert counts is not None and mine is not None and counts.drafted > 0
        assert (counts.drafted, counts.accepted, counts.by_position) == (mine.drafted, mine.accepted, mine.by_position)
