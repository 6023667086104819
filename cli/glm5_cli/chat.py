"""`glm5 chat`: stream a chat completion from a router with the official openai client; reasoning is shown
dimmed before the answer."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DIM, RESET = "\033[2m", "\033[0m"


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

    client = openai.OpenAI(base_url=a.url, api_key="not-needed")
    try:
        model = client.models.list().data[0].id
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
