"""`glm5 generate`: stream one completion from a router (glm5 serve's gRPC port) or a worker over gRPC.

The prompt is raw text unless `--chat` asks the router to wrap it as a user message in the model's chat template
(a worker has no chat template). The demo model answers `What is 12 + 30?` only as a chat: as a raw completion
it continues the text, which is not an answer."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

TARGET_ENV = "GLM5_TARGET"  # host:port `glm5 generate` talks to without --target
DEFAULT_TARGET = "localhost:50050"
DIM, RESET = "\033[2m", "\033[0m"


def add_arguments(g: argparse.ArgumentParser) -> None:
    from glm5.security import add_internal_token_arguments, add_tls_arguments

    g.add_argument("prompt", help="the prompt: raw text, or with --chat one user message")
    g.add_argument("--target", default=os.environ.get(TARGET_ENV) or DEFAULT_TARGET,
                   help=f"host:port of a router (glm5 serve's gRPC port) or a worker (or ${TARGET_ENV})")  # fmt: skip
    g.add_argument("--chat", action="store_true",
                   help="apply the model's chat template (the prompt as one user message; a router only); "
                   "reasoning is shown before the answer")  # fmt: skip
    g.add_argument("--thinking", choices=["off", "light", "deep"],
                   help="with --chat: reasoning for this request (default: the router's thinking policy)")  # fmt: skip
    g.add_argument("--api-key-env", help="environment variable holding the router's API key")
    add_tls_arguments(g)
    add_internal_token_arguments(g)  # a worker started with one answers only callers that send it
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, help="sampling temperature (default: the server's; 0: greedy)")
    g.add_argument("--top-p", type=float, help="nucleus sampling: smallest token set of this probability")
    g.add_argument("--top-k", type=int, help="sample among this many most likely tokens")
    g.add_argument("--seed", type=int, help="sampling seed (the same seed gives the same tokens)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", help="structured output: a JSON Schema (inline JSON, or @FILE)")
    fmt.add_argument("--json-object", action="store_true", help="structured output: any JSON object")
    fmt.add_argument("--regex", help="structured output: the whole completion matches this regular expression")
    fmt.add_argument("--grammar", help="structured output: a Lark grammar (inline, or @FILE)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds the whole call may take")


def run(a: argparse.Namespace) -> None:
    import grpc
    from glm5.client import GenerateClient, sampling
    from glm5.security import internal_token_from_args, read_secrets, tls_from_args
    from glm5.v1 import common_pb2, router_pb2, worker_pb2

    if a.thinking and not a.chat:
        sys.exit("error: --thinking goes with --chat (a raw completion has no chat template to switch it in)")
    keys = read_secrets((), a.api_key_env, None, "API key")
    internal = internal_token_from_args(a)
    started = False

    async def go() -> int:
        nonlocal started
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
            if a.chat:
                tty, thinking = sys.stdout.isatty(), False
                thinking_mode = router_pb2.ThinkingMode.Value(f"THINKING_MODE_{(a.thinking or 'unspecified').upper()}")
                async for chunk in client.chat(request, timeout=a.timeout, thinking=thinking_mode):
                    started = True
                    if chunk.reasoning_delta:
                        if not thinking and tty:
                            sys.stdout.write(DIM)
                        thinking = True
                        sys.stdout.write(chunk.reasoning_delta)
                    if chunk.content_delta:
                        if thinking:
                            sys.stdout.write((RESET if tty else "") + "\n")
                            thinking = False
                        sys.stdout.write(chunk.content_delta)
                    sys.stdout.flush()
                    last = chunk.response
                if thinking and tty:
                    sys.stdout.write(RESET)
            else:
                async for resp in client.generate(request, timeout=a.timeout):
                    started = True
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
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE and not started:
            print(f"error: nothing answers at {a.target} ({exc.details()}); start it with `glm5 serve`, or point "
                  f"--target (or ${TARGET_ENV}) at a router or worker", file=sys.stderr)  # fmt: skip
        elif code == grpc.StatusCode.UNIMPLEMENTED and a.chat:
            print(f"error: --chat needs a router (glm5 serve's gRPC port): {a.target} is not one (a worker has no "
                  f"chat template); leave out --chat for a raw completion", file=sys.stderr)  # fmt: skip
        else:
            print(f"error: {code.name}: {exc.details()}", file=sys.stderr)
        sys.exit(1)


def _inline_or_file(value: str) -> str:
    """`@path` reads the file (curl's convention); anything else is the value itself."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        sys.exit(f"error: cannot read {value[1:]}: {exc.strerror}")
