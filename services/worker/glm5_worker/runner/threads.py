"""Torch work off the engine thread runs on a thread of its own that ends with it.

libgomp (the OpenMP runtime of torch's CPU wheel and of inductor's generated code) keeps a pool of worker threads
for every thread that ever ran a parallel region, for as long as that thread lives. Once the pools together hold
more threads than the machine has cores, every pool spin-waits 100 iterations instead of ~300,000 before it
sleeps, so each of a decode step's many small parallel regions pays a futex wake-up. Measured on 2 cores: a
compiled decode step of the tiny model took 2.6-3.7 ms instead of 1.7 ms when the engine had been built on an
executor thread that stayed alive (as `asyncio.to_thread` leaves it). A thread that exits frees its pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def settle(fut: Future[T], fn: Callable[[], T]) -> BaseException | None:
    """Runs `fn` into `fut` unless it was cancelled first; returns what `fn` raised, if anything."""
    if not fut.set_running_or_notify_cancel():
        return None
    try:
        fut.set_result(fn())
    except BaseException as exc:
        fut.set_exception(exc)
        return exc
    return None


def in_own_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """Runs `fn` on a new thread that exits when it returns; its result or exception lands in the future."""
    fut: Future[T] = Future()
    threading.Thread(target=settle, args=(fut, fn), name=name, daemon=True).start()
    return fut
