"""Held-out evaluation: greedy final-answer accuracy on the held-out problems, played out on the engines (the
weights they serve) before, during and after training."""

from __future__ import annotations

import asyncio
from typing import Any

from glm5.client import WorkerClient, sampling
from glm5.v1 import worker_pb2

from glm5_trainer.config import RLConfig
from glm5_trainer.environment import Outcome, Problem, evaluation_summary, read_turn
from glm5_trainer.rollouts import RolloutDriver

SLOTS_PER_ENGINE = 32  # episodes generating at once per engine


async def evaluate(
    config: RLConfig, engines: list[str], driver: RolloutDriver, label: str, leave: bool = True
) -> tuple[float | None, dict[str, Any] | None]:
    """(accuracy, the episodes' summary with their tool calls), or (None, None) without held-out problems. A
    progress bar counts the problems (200 take minutes)."""
    from tqdm import tqdm

    problems = driver.eval_problems[: config.eval_size]
    if not problems:
        return None, None
    clients = [WorkerClient(e, config.tls, config.internal_token) for e in engines]
    slots = asyncio.Semaphore(SLOTS_PER_ENGINE * len(clients))

    async def one(i: int, p: Problem) -> Outcome:
        async def generate(context: list[int]) -> tuple[list[int], bool]:
            request = worker_pb2.GenerateRequest(
                prompt_token_ids=context, sampling=sampling(temperature=0.0, max_new_tokens=config.max_new_tokens)
            )
            async with slots:
                return await read_turn(clients[i % len(clients)].generate(request, timeout=600))

        outcome = await driver.env.play(p, driver.prompt_ids(p), generate, driver.tok)
        bar.update(1)
        return outcome

    bar = tqdm(total=len(problems), desc=label, unit="problem", leave=leave, disable=not config.progress)
    try:
        outcomes = await asyncio.gather(*(one(i, p) for i, p in enumerate(problems)))
    finally:
        bar.close()
        await asyncio.gather(*(c.close() for c in clients))
    summary = evaluation_summary(outcomes)
    return float(summary["accuracy"]), summary
