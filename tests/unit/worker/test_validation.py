from __future__ import annotations

import logging

import pytest
from glm5.errors import InvalidRequestError
from glm5_worker.engine.sequence import SamplingParams
from glm5_worker.engine.validation import Limits, validate_params, validate_prompt_ids

ASCEND = Limits(vocab_size=100, max_model_len=1024, is_ascend=True, ascend_temperature_floor=0.35)
CPU = Limits(vocab_size=100, max_model_len=1024, is_ascend=False, ascend_temperature_floor=0.35)
BIG_VOCAB = Limits(vocab_size=2000, max_model_len=1024, is_ascend=False, ascend_temperature_floor=0.35)


def test_ascend_raises_low_temperatures_to_the_floor_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert validate_params(SamplingParams(temperature=0.1), 5, ASCEND).temperature == 0.35
    assert "Ascend floor" in caplog.text
    assert validate_params(SamplingParams(temperature=0.0), 5, ASCEND).temperature == 0.0  # greedy stays greedy
    assert validate_params(SamplingParams(temperature=0.7), 5, ASCEND).temperature == 0.7
    assert validate_params(SamplingParams(temperature=0.1), 5, CPU).temperature == 0.1
    off = Limits(vocab_size=100, max_model_len=1024, is_ascend=True, ascend_temperature_floor=0.0)
    assert validate_params(SamplingParams(temperature=0.1), 5, off).temperature == 0.1


def test_penalties_are_bounded_like_openais() -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        for ok in (-2.0, 0.0, 1.5, 2.0):
            assert getattr(validate_params(SamplingParams(**{name: ok}), 5, CPU), name) == ok
        for bad in (-2.5, 2.01, float("nan"), float("inf")):
            with pytest.raises(InvalidRequestError) as err:
                validate_params(SamplingParams(**{name: bad}), 5, CPU)
            assert err.value.field == f"sampling.{name}"


def test_logit_bias_rules() -> None:
    assert validate_params(SamplingParams(logit_bias={5: -100.0, 99: 100.0}), 5, CPU).logit_bias == {
        5: -100.0,
        99: 100.0,
    }
    for bias in ({100: 1.0}, {-1: 1.0}, {5: 100.5}, {5: float("nan")}, {i: 1.0 for i in range(1025)}):
        with pytest.raises(InvalidRequestError) as err:
            validate_params(SamplingParams(logit_bias=bias), 5, BIG_VOCAB if len(bias) > 1 else CPU)
        assert err.value.field == "sampling.logit_bias"


def test_prompt_rules() -> None:
    validate_prompt_ids([1, 2, 99], CPU)
    for ids, field in (([], "prompt"), ([100], "prompt_token_ids"), ([-1], "prompt_token_ids"), ([1] * 1024, "prompt")):
        with pytest.raises(InvalidRequestError) as err:
            validate_prompt_ids(ids, CPU)
        assert err.value.field == field


def test_token_ids_outside_the_vocabulary_are_named_with_their_field() -> None:
    cases = [
        (lambda: validate_prompt_ids([1, 100, 2], CPU), "prompt_token_ids"),
        (lambda: validate_params(SamplingParams(logit_bias={-1: 1.0}), 5, CPU), "sampling.logit_bias"),
        (lambda: validate_params(SamplingParams(stop_token_ids=[3, 250]), 5, CPU), "sampling.stop_token_ids"),
    ]
    for call, field in cases:
        with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \(0\.\.99\)") as err:
            call()
        assert err.value.field == field
    validate_prompt_ids([0, 99], CPU)  # both ends are in
