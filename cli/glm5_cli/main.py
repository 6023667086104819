"""The `glm5` command: one entry point for every service and tool."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import grpc
from glm5.errors import ConfigError, Glm5Error
from glm5.security import add_internal_token_arguments, add_tls_arguments
from glm5.yamlfile import read_yaml


def _init_model(a: argparse.Namespace) -> None:
    from glm5.model.presets import init_model

    path = init_model(a.out, preset=a.preset, seed=a.seed)
    print(f"wrote a random-weight {a.preset} GLM-5 checkpoint with its tokenizer to {path}")


def _generate(a: argparse.Namespace) -> None:
    from glm5.client import GenerateClient, sampling
    from glm5.security import internal_token_from_args, read_secrets, tls_from_args
    from glm5.v1 import common_pb2, worker_pb2

    keys = read_secrets((), a.api_key_env, None, "API key")
    internal = internal_token_from_args(a)

    async def go() -> int:
        async with GenerateClient(a.target, tls_from_args(a), keys[0] if keys else None, internal) as client:
            request = worker_pb2.GenerateRequest(
                prompt=a.prompt,
                sampling=sampling(
                    temperature=a.temperature,
                    top_p=a.top_p,
                    top_k=a.top_k,
                    seed=a.seed,
                    max_new_tokens=a.max_new_tokens,
                    stop=a.stop or None,
                ),
                skip_special_tokens=True,
            )
            if a.json_schema:
                request.sampling.structured_output.json_schema = _inline_or_file(a.json_schema)
            elif a.json_object:
                request.sampling.structured_output.json_object = True
            elif a.regex:
                request.sampling.structured_output.regex = a.regex
            elif a.grammar:
                request.sampling.structured_output.lark_grammar = _inline_or_file(a.grammar)
            last = None
            async for resp in client.generate(request, timeout=a.timeout):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                last = resp
            if last is not None:
                u = last.usage
                reason = common_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
                print(
                    f"\n[{reason}; {u.prompt_tokens} prompt + {u.completion_tokens} generated tokens]", file=sys.stderr
                )
        return 0

    try:
        sys.exit(asyncio.run(go()))
    except grpc.aio.AioRpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        sys.exit(1)


def _inline_or_file(value: str) -> str:
    """`@path` reads the file (curl's convention); anything else is the value itself."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        sys.exit(f"error: cannot read {value[1:]}: {exc.strerror}")


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
    from glm5_tito.app import run

    run(a)


def _demo(a: argparse.Namespace) -> None:
    from glm5_cli.demo import run

    run(a)


def _trainer(a: argparse.Namespace) -> None:
    from glm5_trainer.app import run

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


def build_parser() -> argparse.ArgumentParser:
    from glm5_router.cli import add_arguments as router_arguments
    from glm5_tito.app import add_arguments as tito_arguments
    from glm5_worker.cli import add_arguments as worker_arguments

    from glm5_cli.serve import add_arguments as serve_arguments

    parser = argparse.ArgumentParser(prog="glm5", description="Serve and RL-train GLM-5-family models.")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run workers and the router on this machine (the local stack)")
    serve_arguments(s)
    s.set_defaults(func=_serve)

    c = sub.add_parser("chat", help="chat with a router's OpenAI-compatible API (streams reasoning and answer)")
    c.add_argument("message", nargs="?", help="one message; without it, an interactive session")
    c.add_argument("--url", default="http://localhost:8000/v1")
    c.add_argument("--thinking", choices=["off", "light", "deep"])
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float)
    c.set_defaults(func=_chat)

    t = sub.add_parser("tito-gateway", help="token-in-token-out gateway for RL rollouts over worker engines")
    tito_arguments(t)
    _add_config_file(t)
    t.set_defaults(func=_tito)

    from glm5_trainer.app import add_arguments as trainer_arguments

    from glm5_cli.rl import add_arguments as rl_arguments

    rl = sub.add_parser("rl", help="the RL loop on this machine: rollout workers, TITO gateway and trainer")
    rl_arguments(rl)
    rl.set_defaults(func=_rl)

    tr = sub.add_parser("trainer", help="the RL trainer: rollouts through a TITO gateway, weights to the engines")
    trainer_arguments(tr)
    _add_config_file(tr)
    tr.set_defaults(func=_trainer)

    r = sub.add_parser("router", help="the front door: gRPC + OpenAI-compatible HTTP over workers")
    router_arguments(r)
    _add_config_file(r)
    r.set_defaults(func=_router)

    w = sub.add_parser("worker", help="serve a model over gRPC (the inference engine)")
    worker_arguments(w)
    _add_config_file(w)
    w.set_defaults(func=_worker)

    g = sub.add_parser("generate", help="stream a completion from a worker or router")
    g.add_argument("prompt")
    g.add_argument("--target", default="localhost:50050",
                   help="host:port of a router (glm5 serve's gRPC port) or of a worker")  # fmt: skip
    g.add_argument("--api-key-env", help="environment variable holding the router's API key")
    add_tls_arguments(g)
    add_internal_token_arguments(g)  # a worker started with one answers only callers that send it
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", help="structured output: a JSON Schema (inline JSON, or @FILE)")
    fmt.add_argument("--json-object", action="store_true", help="structured output: any JSON object")
    fmt.add_argument("--regex", help="structured output: the whole completion matches this regular expression")
    fmt.add_argument("--grammar", help="structured output: a Lark grammar (inline, or @FILE)")
    g.add_argument("--timeout", type=float, default=300.0)
    g.set_defaults(func=_generate)

    o = sub.add_parser("operator", help="run the Kubernetes operator against the current kubeconfig / service account")
    o.add_argument("--namespace", help="watch only this namespace (default: all, or $GLM5_WATCH_NAMESPACE)")
    o.add_argument("--image", help="default image for workers, router, gateway and trainer (or $GLM5_IMAGE)")
    o.add_argument("--health-port", type=int, default=8080, help="serve /healthz on this port (0: off)")
    o.add_argument("--health-host", default="127.0.0.1", help="address of /healthz (the chart sets 0.0.0.0)")
    o.add_argument("--verbose", action="store_true")
    o.set_defaults(func=_operator)

    from glm5_cli.demo import add_arguments as demo_arguments

    d = sub.add_parser("demo-model", help="train the shipped demo model (addition) and measure it")
    demo_arguments(d)
    d.set_defaults(func=_demo)

    from glm5_cli.export import add_arguments as export_arguments

    e = sub.add_parser("export-demo", help="write the demo model and its addition problems to files (a volume)")
    export_arguments(e)
    e.set_defaults(func=_export_demo)

    from glm5_cli.quantize import add_arguments as quantize_arguments

    q = sub.add_parser("quantize", help="quantize a float checkpoint: block FP8, W4A16 or INT4 experts + FP8")
    quantize_arguments(q)
    q.set_defaults(func=_quantize)

    m = sub.add_parser("init-model", help="write a small random-weight GLM-5-architecture checkpoint")
    m.add_argument("--preset", default="tiny")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=_init_model)
    return parser


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
        if action is None:
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ConfigError(f"config file {path}: {key!r} takes true or false, got {value!r}")
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
