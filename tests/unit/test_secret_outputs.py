"""A Secret reaches no output file: `dataclasses.asdict` of a config holding one (how `glm5 rl` once wrote its
admin token into summary.json), `json.dumps(..., default=str)`, repr, str and f-strings all show it hidden, and
`public_view` (what summary.json's settings go through) shows "***" and strips a Redis URL's password. A spawned
process still gets the value (pickling keeps it)."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

from glm5.security import Secret, public_view
from glm5_trainer.config import RLConfig

VALUE = "s3cr3t-value-that-must-not-show"


def test_secret_hides_its_value_from_asdict_json_and_formatting() -> None:
    @dataclasses.dataclass
    class Config:
        token: Secret

    secret = Secret(VALUE)
    written = json.dumps(dataclasses.asdict(Config(secret)), default=str)
    for text in (written, repr(secret), str(secret), f"{secret}", repr(Config(secret))):
        assert VALUE not in text, text


def test_secret_compares_hashes_and_pickles_by_value() -> None:
    secret = Secret(VALUE)
    assert secret == Secret(VALUE) and secret != Secret("other") and hash(secret) == hash(Secret(VALUE))
    assert pickle.loads(pickle.dumps(secret)).value == VALUE  # the rollout producer is a spawned process
    assert secret.matches(VALUE) and not secret.matches(VALUE + "x")


def test_public_view_of_the_trainer_config() -> None:
    config = RLConfig(policy=Path("p"), gateway="g:1", out=Path("o"), engines=("e:1",), admin_token=Secret(VALUE),
                      internal_token=Secret(VALUE + "2"), redis_url="redis://user:pw-in-url@redis:6379/0")  # fmt: skip
    view = public_view(config)
    text = json.dumps(view)  # plain JSON data: no default= needed
    assert VALUE not in text and "pw-in-url" not in text
    assert view["admin_token"] == view["internal_token"] == "***"
    assert view["redis_url"] == "redis://user:***@redis:6379/0"
    assert view["policy"] == "p" and view["engines"] == ["e:1"] and view["region"]["eps_low"] == 0.15
