"""`glm5 chat`: stream a chat completion from a router with the official openai client; reasoning is shown
dimmed before the answer."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

DIM, RESET = "\033[2m", "\033[0m"
URL_ENV = "GLM5_URL"  # the OpenAI-compatible base URL `glm5 chat` talks to without --url
DEFAULT_URL = "http://localhost:8000/v1"
KEY_ENVS = (
    "GLM5_API_KEY",
    "OPENAI_API_KEY",
)  # the router's API key, when it wants one (never a flag: `ps` shows those)
CONNECT_TIMEOUT_S = 3.0  # the first call: nothing listening fails at once, a host that drops packets in this


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("message", nargs="?", help="one message; without it, an interactive session")
    c.add_argument("--url", default=os.environ.get(URL_ENV) or DEFAULT_URL,
                   help=f"OpenAI-compatible base URL of a router, as glm5 serve prints it (or ${URL_ENV})")  # fmt: skip
    c.add_argument("--thinking", choices=["off", "light", "deep"],
                   help="reasoning for this chat (default: the router's --thinking-policy)")  # fmt: skip
    c.add_argument("--max-tokens", type=int, default=256, help="tokens generated per reply at most")
    c.add_argument("--temperature", type=float, help="sampling temperature (default: the server's; 0: greedy)")


def _once(client: Any, model: str, history: list[dict[str, Any]], a: argparse.Namespace) -> str:
    extra: dict[str, Any] = {}
    if a.thinking:
        extra["thinking"] = {"type": "disabled" if a.thinking == "off" else "enabled"}
    kwargs: dict[str, Any] = {"max_tokens": a.max_tokens}
    if a.temperature is not None:
        kwargs["temperature"] = a.temperature
    stream = client.chat.completions.create(model=model, messages=history, stream=True, extra_body=extra, **kwargs)
    answer, thinking = [], False
    tty = sys.stdout.isatty()
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning = (delta.model_extra or {}).get("reasoning_content")
        if reasoning:
            if not thinking and tty:
                sys.stdout.write(DIM)
            thinking = True
            sys.stdout.write(reasoning)
        if delta.content:
            if thinking:
                sys.stdout.write((RESET if tty else "") + "\n")
                thinking = False
            sys.stdout.write(delta.content)
            answer.append(delta.content)
        sys.stdout.flush()
    sys.stdout.write((RESET if thinking and tty else "") + "\n")
    return "".join(answer)


def run(a: argparse.Namespace) -> int:
    import openai

    key = next((os.environ[k] for k in KEY_ENVS if os.environ.get(k)), "not-needed")
    client = openai.OpenAI(base_url=a.url, api_key=key)
    try:
        try:
            # no retries and a short timeout for the first call: the client's own (2 retries with backoff, a
            # 10-minute timeout) made "nothing is running" a long wait ending in "Connection error."
            first = client.with_options(max_retries=0, timeout=openai.Timeout(30.0, connect=CONNECT_TIMEOUT_S))
            model = first.models.list().data[0].id
        except openai.APIConnectionError as exc:
            print(f"error: nothing answers at {a.url} ({exc.__cause__ or exc}); start it with `glm5 serve`, or "
                  f"point --url (or ${URL_ENV}) at a router", file=sys.stderr)  # fmt: skip
            return 1
        except openai.AuthenticationError:
            print(f"error: {a.url} wants an API key: set {KEY_ENVS[0]}", file=sys.stderr)
            return 1
        history: list[dict[str, Any]] = []
        messages = [a.message] if a.message else None
        while True:
            text = messages.pop(0) if messages else (None if a.message else input("> "))
            if text is None:
                return 0
            history.append({"role": "user", "content": text})
            history.append({"role": "assistant", "content": _once(client, model, history, a)})
    except (EOFError, KeyboardInterrupt):
        return 0
    except openai.APIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
