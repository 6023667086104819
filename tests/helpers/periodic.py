"""A background pass repeated every few seconds (the pod runner's, the autoscaler's): a failing pass is logged and
the next one runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


def every(interval: float, step: Callable[[], Awaitable[None]], what: str) -> asyncio.Task[None]:
    async def loop() -> None:
        while True:
            try:
                await step()
            except Exception:
                log.exception("%s pass failed", what)
            await asyncio.sleep(interval)

    return asyncio.create_task(loop())


async def cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
