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


def test_seed_fixes_the_draw() -> None:
    logits = torch.randn(1, 50)
    sampler = Sampler(0, torch.device("cpu"))
    a = [sampler.sample(logits, [seq(seed=7)])[0].token_id for _ in range(3)]
    b = [sampler.sample(logits, [seq(seed=7)])[0].token_id for _ in range(3)]
    assert a == b
