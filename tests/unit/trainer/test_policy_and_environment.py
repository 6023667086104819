"""The trainer's policy step (malformed batches refused whole, weights untouched), reward environments and
datasets, and the `glm5 trainer` flags."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from glm5.errors import ConfigError
from glm5.model.presets import SHIPPED_MODEL
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import tito_pb2
from glm5_cli.main import parse_args
from glm5_trainer.cli import config_from_args
from glm5_trainer.environment import builtin_problems, environment, load_problems
from glm5_trainer.policy import MalformedBatch, Policy, make_batch
from glm5_trainer.sft import problem


@pytest.fixture(scope="module")
def policy() -> Policy:
    return Policy(SHIPPED_MODEL, learning_rate=1e-3)


def _record(tok: Tokenizer, a: int, b: int, rid: str, group: str, reward: float) -> tito_pb2.RolloutRecord:
    messages, answer = problem(a, b)
    prompt = tok.encode(tok.apply_chat_template(messages, enable_thinking=True))
    out = tok.encode(answer)
    n = len(prompt) + len(out)
    return tito_pb2.RolloutRecord(
        rollout_id=rid, group_id=group, token_ids=prompt + out, loss_mask=[0] * len(prompt) + [1] * len(out),
        logprobs=[0.0] * len(prompt) + [-0.5] * len(out), token_versions=[0] * n, turn_versions=[0], reward=reward,
    )  # fmt: skip


def test_step_learns_from_group_advantages_and_refuses_malformed_batches(policy: Policy) -> None:
    tok = Tokenizer(SHIPPED_MODEL)
    good = [_record(tok, 2, 3, "a", "g", 1.0), _record(tok, 2, 4, "b", "g", 0.0)]
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}

    bad_token = tito_pb2.RolloutRecord()
    bad_token.CopyFrom(good[1])
    bad_token.token_ids[-1] = policy.vocab_size  # outside the vocabulary
    bad_lengths = tito_pb2.RolloutRecord()
    bad_lengths.CopyFrom(good[1])
    del bad_lengths.logprobs[-1]
    bad_logprob = tito_pb2.RolloutRecord()
    bad_logprob.CopyFrom(good[1])
    bad_logprob.logprobs[-1] = 0.7
    for bad, message in ((bad_token, "outside the vocabulary"), (bad_lengths, "must agree"),
                         (bad_logprob, "finite and <= 0")):  # fmt: skip
        with pytest.raises(MalformedBatch, match=message):
            policy.step([good[0], bad])
        assert all(torch.equal(v, policy.model.state_dict()[k]) for k, v in state.items())  # nothing applied
    with pytest.raises(MalformedBatch, match="empty"):
        make_batch([], policy.vocab_size)

    # the engine said -0.5 per token; the trained model is confident on most of these tokens (log-prob near 0),
    # so their ratio exp(logp + 0.5) ~ 1.65 leaves the math trust region (above 1.35) and only the rest is kept
    ratios = [math.exp(lp + 0.5) for lps in policy.recompute(good) for lp in lps]
    stats = policy.step(good)
    assert stats.tokens == sum(sum(r.loss_mask) for r in good) == len(ratios)
    assert stats.reward == 0.5 and stats.nonfinite_grads == 0
    assert stats.clipped_high == sum(r > 1.35 for r in ratios) > stats.tokens // 2
    assert stats.clipped_low == sum(r < 0.85 for r in ratios) and stats.kept == stats.tokens - stats.clipped_high
    assert stats.aux_loss != 0.0  # the MoE balance / router-entropy terms were captured by the router hooks
    assert any(not torch.equal(v, policy.model.state_dict()[k]) for k, v in state.items())


def test_recompute_matches_what_step_sees(policy: Policy) -> None:
    tok = Tokenizer(SHIPPED_MODEL)
    rec = _record(tok, 10, 20, "c", "h", 1.0)
    (lps,) = policy.recompute([rec])
    assert len(lps) == sum(rec.loss_mask) and all(lp <= 0 for lp in lps)


def test_environment_and_datasets(tmp_path: Path) -> None:
    env = environment("addition")
    train, held_out = builtin_problems()
    assert len(held_out) == 500 and len(train) == 100 * 100 - 500
    assert not {p.id for p in train} & {p.id for p in held_out}
    p = held_out[0]
    assert env.reward(p, f"<think>...</think>The answer is {p.answer}.") == 1.0
    assert env.reward(p, f"The answer is {int(p.answer) + 1}. The answer is {p.answer}.") == 0.0  # the first counts
    assert env.reward(p, "no answer") == 0.0
    with pytest.raises(ConfigError, match="unknown environment 'chess'"):
        environment("chess")

    f = tmp_path / "problems.jsonl"
    lines = [{"prompt": "What is 1 + 1?", "answer": 2}, {"messages": [{"role": "user", "content": "x"}],
                                                         "answer": "7", "split": "eval"}]  # fmt: skip
    f.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")
    train, evaluation = load_problems(str(f))
    assert [p.answer for p in train] == ["2"] and [p.answer for p in evaluation] == ["7"]
    assert train[0].messages == ({"role": "user", "content": "What is 1 + 1?"},)
    cases = [("{", r"problems.jsonl:1: not JSON"), ('{"prompt": "x"}', "'answer'"), ('{"answer": 1}', "'prompt'"),
             ('{"answer": 1, "prompt": "x", "split": "dev"}', "'split'"),
             ('{"answer": 1, "messages": [{"role": "user"}]}', "string 'role' and 'content'")]  # fmt: skip
    for line, message in cases:
        f.write_text(line + "\n")
        with pytest.raises(ConfigError, match=message):
            load_problems(str(f))
    with pytest.raises(ConfigError, match="cannot read dataset"):
        load_problems(str(tmp_path / "missing.jsonl"))


def test_trainer_flags(tmp_path: Path) -> None:
    def config(*flags: str) -> object:
        return config_from_args(parse_args(["trainer", *flags]))

    with pytest.raises(ConfigError, match="--policy"):
        config("--gateway", "x:1")
    base = ("--policy", str(SHIPPED_MODEL), "--gateway", "127.0.0.1:1")
    with pytest.raises(ConfigError, match="engines"):
        config(*base)
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        config(*base, "--engine", "e:1", "--group-size", "1")
    with pytest.raises(ConfigError, match="preset 'custom' needs explicit eps_low and eps_high"):
        config(*base, "--engine", "e:1", "--task-preset", "custom")
    c = config(*base, "--engine", "e:1", "--task-preset", "terminal", "--eps-high", "0.3", "--mode", "sync")
    assert (c.region.eps_low, c.region.eps_high, c.mode) == (0.05, 0.3, "sync")  # type: ignore[attr-defined]


def test_sync_plan_names_the_published_tensors_and_splits_rows_as_torch_chunk(policy: Policy) -> None:
    from glm5.model.loader import checkpoint_state_dict
    from glm5_trainer.sync import _chunks, held, manifest

    for rows in (1, 5, 7, 10, 64):
        for senders in (1, 2, 3, 4):
            want = [len(c) for c in torch.chunk(torch.arange(rows), senders)]
            assert [n for _, n in _chunks(rows, senders)] == want, (rows, senders)
    published = checkpoint_state_dict(policy.model)  # type: ignore[arg-type]  # transformers' model, same names
    plan = manifest(policy.model, 4, 1 << 16)
    specs = [t for b in plan.buckets for t in b]
    assert sorted(t.name for t in specs) == sorted(published) and len(plan.buckets) > 3
    assert all(t.shape == tuple(published[t.name].shape) and t.pieces == ((0, t.nbytes),) for t in specs)
    mine = held(policy.model, 0, 1)  # one rank holds everything, as views of the model's own tensors
    assert set(mine) == set(published) and all(torch.equal(mine[k], v) for k, v in published.items())
