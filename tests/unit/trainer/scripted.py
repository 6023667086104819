"""An episode of the tool environment played with the model's turns given in advance (token ids)."""

from __future__ import annotations

import asyncio

from glm5.tokenizer.tokenizer import Tokenizer
from glm5_trainer.environment import Outcome, Problem, ToolUse


def play_turns(p: Problem, prompt: list[int], turns: list[list[int]], tok: Tokenizer,
               env: ToolUse | None = None) -> tuple[Outcome, list[list[int]]]:  # fmt: skip
    """Plays `p` from `prompt` answering turn i with `turns[i]`; returns the outcome and every turn's context."""
    contexts: list[list[int]] = []

    async def generate(context: list[int]) -> tuple[list[int], bool]:
        contexts.append(list(context))
        return turns[len(contexts) - 1], False

    return asyncio.run((env or ToolUse()).play(p, prompt, generate, tok)), contexts
