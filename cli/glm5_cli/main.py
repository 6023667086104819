"""The `glm5` command: one entry point for every service and tool.

Nothing heavy is imported here: each sub-command's flags are declared, and its module imported, only when that
sub-command runs or shows its help (glm5_cli.lazy), so `glm5 --help` and `glm5 chat` start at once."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glm5.errors import ConfigError, Glm5Error

from glm5_cli.lazy import Declare, HelpFormatter, LazyParser


def _init_model(a: argparse.Namespace) -> None:
    from glm5.model.presets import init_model

    path = init_model(a.out, preset=a.preset, seed=a.seed, mtp_layers=a.mtp_layers)
    print(f"wrote a random-weight {a.preset} GLM-5 checkpoint with its tokenizer to {path}")


def _generate(a: argparse.Namespace) -> None:
    from glm5_cli.generate import run

    run(a)


def _export_demo(a: argparse.Namespace) -> None:
    from glm5_cli.export import run

    run(a)


def _quantize(a: argparse.Namespace) -> None:
    from glm5_cli.quantize import run

    run(a)


def _worker(a: argparse.Namespace) -> None:
    from glm5_worker.cli import run

    run(a)


def _operator(a: argparse.Namespace) -> None:
    import asyncio
    import logging

    from glm5_operator.config import OperatorConfig
    from glm5_operator.handlers import run
    from glm5_operator.kube import Kube

    problem = Kube.credentials_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(1)

    logging.basicConfig(
        level=logging.DEBUG if a.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    env = OperatorConfig.from_env()
    try:
        config = OperatorConfig(
            image=a.image or env.image,
            image_pull_policy=env.image_pull_policy,
            namespace=a.namespace or env.namespace,
            retry_delay_s=env.retry_delay_s,
            worker_startup_seconds=env.worker_startup_seconds,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    liveness = f"http://{a.health_host}:{a.health_port}/healthz" if a.health_port else None
    asyncio.run(run(config, liveness_endpoint=liveness))


def _router(a: argparse.Namespace) -> None:
    from glm5_router.cli import run

    run(a)


def _tito(a: argparse.Namespace) -> None:
    from glm5_tito.cli import run

    run(a)


def _demo(a: argparse.Namespace) -> None:
    from glm5_cli.demo import run

    run(a)


def _trainer(a: argparse.Namespace) -> None:
    from glm5_trainer.cli import run

    run(a)


def _rl(a: argparse.Namespace) -> None:
    from glm5_cli.rl import run

    run(a)


def _serve(a: argparse.Namespace) -> None:
    from glm5_cli.serve import run

    run(a)


def _chat(a: argparse.Namespace) -> None:
    from glm5_cli.chat import run

    sys.exit(run(a))


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_cli.serve import add_arguments

    add_arguments(p)


def _chat_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_cli.chat import add_arguments

    add_arguments(p)


def _tito_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_tito.cli import add_arguments

    add_arguments(p)
    _add_config_file(p)


def _rl_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_cli.rl import add_arguments

    add_arguments(p)


def _trainer_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_trainer.cli import add_arguments

    add_arguments(p)
    _add_config_file(p)


def _router_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_router.cli import add_arguments

    add_arguments(p)
    _add_config_file(p)


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_worker.cli import add_arguments

    add_arguments(p)
    _add_config_file(p)


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_cli.generate import add_arguments

    add_arguments(p)


def _operator_arguments(o: argparse.ArgumentParser) -> None:
    o.add_argument("--namespace", help="watch only this namespace (default: all, or $GLM5_WATCH_NAMESPACE)")
    o.add_argument("--image", help="default image for workers, router, gateway and trainer (or $GLM5_IMAGE)")
    o.add_argument("--health-port", type=int, default=8080, help="serve /healthz on this port (0: off)")
    o.add_argument("--health-host", default="127.0.0.1", help="address of /healthz (the chart sets 0.0.0.0)")
    o.add_argument("--verbose", action="store_true", help="debug logging")


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_cli.demo import add_arguments

    add_arguments(p)


def _export_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_cli.export import add_arguments

    add_arguments(p)


def _quantize_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_cli.quantize import add_arguments

    add_arguments(p)


def _init_model_arguments(m: argparse.ArgumentParser) -> None:
    m.add_argument("--preset", default="tiny", help="model size (glm5.model.presets: tiny, ...)")
    m.add_argument("--out", required=True, help="checkpoint directory to write")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    m.add_argument("--mtp-layers", type=int, default=0,
                   help="multi-token-prediction layers written after the decoder layers (MTP speculation)")  # fmt: skip


# name, one-line help, flags (declared when the sub-command is used), what runs it
COMMANDS: tuple[tuple[str, str, Declare, Callable[[argparse.Namespace], None]], ...] = (
    ("serve", "run workers and the router on this machine (the local stack)", _serve_arguments, _serve),
    ("chat", "chat with a router's OpenAI-compatible API (streams reasoning and answer)", _chat_arguments, _chat),
    ("tito-gateway", "token-in-token-out gateway for RL rollouts over worker engines", _tito_arguments, _tito),
    ("rl", "the RL loop on this machine: rollout workers, TITO gateway and trainer", _rl_arguments, _rl),
    ("trainer", "the RL trainer: rollouts through a TITO gateway, weights to the engines", _trainer_arguments,
     _trainer),
    ("router", "the front door: gRPC + OpenAI-compatible HTTP over workers", _router_arguments, _router),
    ("worker", "serve a model over gRPC (the inference engine)", _worker_arguments, _worker),
    ("generate", "stream a completion from a router or worker (--chat: with the chat template)",
     _generate_arguments, _generate),
    ("operator", "run the Kubernetes operator against the current kubeconfig / service account",
     _operator_arguments, _operator),
    ("demo-model", "train the shipped demo model (addition) and measure it", _demo_arguments, _demo),
    ("export-demo", "write the demo model and its addition problems to files (a volume)", _export_arguments,
     _export_demo),
    ("quantize", "quantize a float checkpoint: block FP8, W4A16 or INT4 experts + FP8", _quantize_arguments,
     _quantize),
    ("init-model", "write a small random-weight GLM-5-architecture checkpoint", _init_model_arguments, _init_model),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The `glm5` parser; each sub-command's flags are declared when it is used (`LazyParser.declare`)."""
    parser = argparse.ArgumentParser(prog="glm5", description="Serve and RL-train GLM-5-family models.",
                                     formatter_class=HelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser, metavar="COMMAND")
    for name, summary, declare, func in COMMANDS:
        s = sub.add_parser(name, help=summary, description=summary, declare=declare)
        s.set_defaults(func=func)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, LazyParser]:
    """The sub-commands' parsers by name, their flags declared (the help tests walk them)."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: p.declare() for name, p in action.choices.items() if isinstance(p, LazyParser)}


def _add_config_file(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        help="YAML/JSON file of flag values ({max-model-len: 4096, dynamic-sparsity: true}); flags given on the "
        "command line win (the operator mounts one from a ConfigMap)",
    )
    p.set_defaults(_parser=p)


def _config_defaults(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """Flag values from a config file, checked against the sub-command's flags so a typo is an error."""
    from glm5.yamlfile import read_yaml

    data = read_yaml(path, "config file", kind="YAML/JSON")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of flag names to values")
    known = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).removeprefix("--").replace("-", "_")
        action = known.get(dest)
        negated = action is None and isinstance(known.get(dest.removeprefix("no_")), argparse.BooleanOptionalAction)
        if negated:  # `no-prefix-caching: true`, as a --no-prefix-caching flag says it
            dest = dest.removeprefix("no_")
            action = known[dest]
        if action is None:
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ConfigError(f"config file {path}: {key!r} takes true or false, got {value!r}")
            value = value != negated
        elif value is not None and action.type is not None and not isinstance(value, bool):
            try:
                value = action.type(value)  # type: ignore[operator]
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"config file {path}: {key!r}: {exc}") from exc
        if action.choices is not None and value not in action.choices:
            raise ConfigError(f"config file {path}: {key!r} must be one of {list(action.choices)}, got {value!r}")
        out[dest] = value
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    sub: argparse.ArgumentParser | None = getattr(args, "_parser", None)
    if sub is not None and args.config is not None:
        sub.set_defaults(**_config_defaults(sub, args.config))
        args = parser.parse_args(argv)  # command-line flags override the file
    return args


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_args(argv)
        args.func(args)
    except Glm5Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
