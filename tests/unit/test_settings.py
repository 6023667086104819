"""Settings declared once (issue 38, item 5): each service's config dataclass carries its flags (glm5.settings);
argparse, the config file and the config object are generated from the fields, so a flag's default is the
field's and a field without help fails here."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Literal

import pytest
from glm5.security import NO_TLS, TlsConfig
from glm5.settings import add_flags, derived, from_flags, setting, undeclared
from glm5_cli.main import parse_args
from glm5_router.config import BreakerConfig, RouterConfig
from glm5_tito.gateway import GatewayConfig
from glm5_trainer.config import RLConfig
from glm5_worker.config import EngineConfig

CONFIGS = (EngineConfig, RouterConfig, BreakerConfig, RLConfig, GatewayConfig)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_is_a_flag_with_help_or_says_where_it_comes_from(cls: type) -> None:
    assert not undeclared(cls)


def test_a_field_without_help_or_reason_is_found() -> None:
    @dataclasses.dataclass
    class Loose:
        ok: int = setting(1, help="documented")
        built: str = derived("", why="from --x and --y")
        bare: int = 0
        empty: int = setting(0, help=" ")

    assert undeclared(Loose) == ["Loose.bare", "Loose.empty"]


def _parser(*classes: tuple[type, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    for cls, prefix in classes:
        add_flags(p, cls, prefix)
    return p


@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float = setting(0.5, name="error-rate", help="r")


@dataclasses.dataclass(frozen=True)
class Demo:
    size: int = setting(7, help="an int")
    limit: int | None = setting(None, help="optional", group="limits")
    on: bool = setting(True, help="negatable")
    mode: Literal["a", "b"] = setting("a", help="choices from the Literal")
    hosts: tuple[str, ...] = setting((), name="host", repeat=True, help="repeatable")
    path: Path | None = setting(None, help="a path")
    scaled: int | None = setting(None, given="3", type=str, convert=lambda t: int(t) * 10, help="converted")
    inner: Inner = derived(default_factory=Inner, why="the --inner-* flags")


def test_flags_take_their_kind_from_the_field() -> None:
    p = _parser((Demo, ""), (Inner, "inner-"))
    assert [g.title for g in p._action_groups if g._group_actions][-1] == "limits"
    a = p.parse_args([])
    assert from_flags(Demo, a, inner=from_flags(Inner, a, "inner-")) == Demo(scaled=30)
    a = p.parse_args(["--size", "9", "--limit", "4", "--no-on", "--mode", "b", "--host", "x:1", "--host", "y:2",
                      "--path", "/p", "--scaled", "5", "--inner-error-rate", "0.25"])  # fmt: skip
    got = from_flags(Demo, a, inner=from_flags(Inner, a, "inner-"))
    assert got == Demo(9, 4, False, "b", ("x:1", "y:2"), Path("/p"), 50, Inner(0.25))
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])
    with pytest.raises(SystemExit):
        p.parse_args(["--size", "x"])


def test_a_flag_default_is_the_field_default() -> None:
    """What each service builds from its flags alone equals its dataclass' defaults: the flag's default is read
    from the field, so the two cannot drift apart (they did: three declarations each before)."""
    worker = parse_args(["worker", "--speculative-config", "none"])
    from glm5_worker.cli import config_from_args as worker_config

    assert worker_config(worker) == EngineConfig()
    from glm5_router.cli import config_from_args as router_config

    router = router_config(parse_args(["router", "--worker", "w:1"]))
    # the router's API takes API keys rather than client certificates (--tls-require-client-cert turns them on)
    assert router.tls == TlsConfig(require_client_cert=False)
    assert dataclasses.replace(router, tls=NO_TLS) == RouterConfig(workers=("w:1",))
    from glm5_tito.cli import config_from_args as gateway_config

    assert gateway_config(parse_args(["tito-gateway", "--engine", "e:1"])) == GatewayConfig(engines=("e:1",))


def test_trainer_defaults_and_required_flags(tmp_path: Path) -> None:
    from glm5.errors import ConfigError
    from glm5_trainer.cli import config_from_args

    (tmp_path / "config.json").write_text("{}")
    got = config_from_args(parse_args(["trainer", "--policy", str(tmp_path), "--gateway", "g:1", "--engine", "e:1"]))
    assert got == RLConfig(policy=tmp_path, gateway="g:1", out=Path("rl-out"), engines=("e:1",))
    with pytest.raises(ConfigError, match="--policy"):
        config_from_args(parse_args(["trainer", "--gateway", "g:1"]))


def test_config_file_keys_are_the_flags_and_their_negations(tmp_path: Path) -> None:
    from glm5.errors import ConfigError
    from glm5_worker.cli import config_from_args

    path = tmp_path / "worker.yaml"
    path.write_text("no-prefix-caching: true\nkv-int8-tier: false\nmax-num-seqs: 5\ncompile-budget: 12\n")
    got = config_from_args(parse_args(["worker", "--config", str(path)]))
    assert (got.enable_prefix_caching, got.kv_int8_tier, got.max_num_seqs, got.compile_budget_s) == (False, False, 5,
                                                                                                     12.0)  # fmt: skip
    # the command line wins over the file, either spelling
    got = config_from_args(parse_args(["worker", "--config", str(path), "--prefix-caching"]))
    assert got.enable_prefix_caching
    path.write_text("no-max-num-seqs: 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'no-max-num-seqs'"):
        parse_args(["worker", "--config", str(path)])
    path.write_text("no-prefix-caching: 1\n")
    with pytest.raises(ConfigError, match="takes true or false"):
        parse_args(["worker", "--config", str(path)])
