from __future__ import annotations

import torch
from glm5_worker.engine.sampler import Sampler
from glm5_worker.engine.sequence import SamplingParams, Sequence


def seq(**kw) -> Sequence:
    s = Sequence("r", [1, 2, 3], SamplingParams(**kw), detokenizer=None)  # type: ignore[arg-type]
    if kw.get("seed") is not None:
        s.generator = torch.Generator().manual_seed(kw["seed"])
    return s


def test_greedy_and_logprobs_are_of_the_raw_distribution() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    out = Sampler(0, torch.device("cpu")).sample(logits, [seq(temperature=0.0, logprobs=True, top_logprobs=2)])
    assert out[0].token_id == 1
    assert abs(out[0].logprob - float(torch.log_softmax(logits, -1)[0, 1])) < 1e-6
    assert [t for t, _ in out[0].top] == [1, 2]


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(0, torch.device("cpu"))
    seen_k = {sampler.sample(logits, [seq(top_k=2, seed=i)])[0].token_id for i in range(200)}
    seen_p = {sampler.sample(logits, [seq(top_p=0.7, seed=i)])[0].token_id for i in range(200)}
    assert seen_k == {0, 1} and seen_p == {0, 1}
    seen_all = {sampler.sample(logits, [seq(seed=i)])[0].token_id for i in range(400)}
    assert seen_all == {0, 1, 2, 3}


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0, 0.0]])  # token 1 is in the prompt [1, 2, 3]
    sampler = Sampler(0, torch.device("cpu"))
    assert sampler.sample(logits, [seq(temperature=0.0)])[0].token_id == 1
    penalised = seq(temperature=0.0, repetition_penalty=2.0)
    penalised.prompt_ids = [1]
    assert sampler.sample(logits, [penalised])[0].token_id == 2


def test_presence_and_frequency_penalties_are_openais_over_generated_tokens() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, 0.5]])
    sampler = Sampler(0, torch.device("cpu"))
    s = seq(temperature=0.0, logprobs=True, presence_penalty=0.6, frequency_penalty=0.3)
    s.prompt_ids = [4, 4, 4]  # the prompt is not penalised
    s.output_ids = [1, 1, 2]
    penalised = sampler._penalise(logits, [s])
    # token 1: 3 - 0.6 - 2 * 0.3; token 2: 2 - 0.6 - 0.3; the rest untouched
    assert torch.allclose(penalised, torch.tensor([[0.0, 1.8, 1.1, 1.0, 0.5]]))
    out = sampler.sample(logits, [s])[0]
    assert out.token_id == 1  # still the most likely after penalties (1.8 > 1.1 > 1.0)
    # logprobs stay those of the raw distribution
    assert abs(out.logprob - float(torch.log_softmax(logits, -1)[0, 1])) < 1e-6
    s.output_ids = [1, 1, 1, 1]
    assert sampler.sample(logits, [s])[0].token_id == 2  # 3 - 0.6 - 1.2 = 1.2 < 2.0
    negative = seq(temperature=0.0, presence_penalty=-2.0)
    negative.output_ids = [2]
    assert sampler.sample(logits, [negative])[0].token_id == 2  # a negative penalty favours repeats (4.0 > 3.0)
    assert sampler._penalise(logits, [seq(presence_penalty=1.0)]) is logits  # nothing generated yet: no copy


def test_logit_bias_forces_or_bans_tokens_and_leaves_logprobs_raw() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, 0.5]])
    sampler = Sampler(0, torch.device("cpu"))
    forced = seq(temperature=0.0, logprobs=True, logit_bias={4: 100.0})
    out = sampler.sample(logits, [forced])[0]
    assert out.token_id == 4 and abs(out.logprob - float(torch.log_softmax(logits, -1)[0, 4])) < 1e-6
    assert sampler.sample(logits, [seq(temperature=0.0, logit_bias={1: -100.0})])[0].token_id == 2
    # sampled rows: a banned token is never drawn, a forced one always is
    assert all(sampler.sample(logits, [seq(seed=i, logit_bias={0: 100.0})])[0].token_id == 0 for i in range(20))
    draws = {sampler.sample(logits, [seq(seed=i, logit_bias={1: -100.0, 2: -100.0})])[0].token_id for i in range(50)}
    assert draws and not draws & {1, 2}


def test_seed_fixes_the_draw() -> None:
    logits = torch.randn(1, 50)
    sampler = Sampler(0, torch.device("cpu"))
    a = [sampler.sample(logits, [seq(seed=7)])[0].token_id for _ in range(3)]
    b = [sampler.sample(logits, [seq(seed=7)])[0].token_id for _ in range(3)]
    assert a == b


def test_draws_follow_the_distribution_and_ignore_the_rest_of_the_batch() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = torch.log(probs)[None]
    sampler = Sampler(0, torch.device("cpu"))
    n = 4000
    counts = torch.zeros(5)
    for _ in range(n // 100):  # 100 unseeded rows per batched draw
        out = sampler.sample(logits.expand(100, -1), [seq() for _row in range(100)])
        for t in out:
            counts[t.token_id] += 1
    assert counts[4] == 0  # zero probability is never drawn
    # chi-square over the 4 live tokens, 3 degrees of freedom: 16.3 is the 0.1% tail
    expected = probs[:4] * n
    assert float(((counts[:4] - expected) ** 2 / expected).sum()) < 16.3
    # a seeded row draws the same token whatever shares its batch
    alone = [sampler.sample(logits, [seq(seed=s)])[0].token_id for s in range(50)]
    crowded = [sampler.sample(logits.expand(3, -1), [seq(), seq(seed=s), seq(seed=99)])[1].token_id for s in range(50)]
    assert alone == crowded and len(set(alone)) > 1
