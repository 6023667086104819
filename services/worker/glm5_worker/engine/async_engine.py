"""Runs the engine on its own thread and streams outputs to asyncio callers.

Every engine call (add, abort, stats) is a command queued to the engine thread, so the engine is only ever
touched by one thread and model steps never block the event loop. The engine is also built on that thread
(weights read): OpenMP keeps a thread pool per thread that ran torch code, and a second live pool slows every
step (threads.py). Its decode steps compile on a thread that exits when they are built (seconds from the cache,
minutes cold) while the engine thread serves eagerly; a command then switches the engine to them between two
steps.

It is the server's only door to the engine: the facts a server answers with (`info`, `tokenizer`), the stats,
weight updates (read on a thread of their own, swapped on the engine thread) and requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from glm5.errors import CheckpointError, ConfigError, Glm5Error, InvalidRequestError
from glm5.osthread import name_os_thread
from glm5.tokenizer import Tokenizer

from glm5_worker.engine.engine import Engine, EngineStats, RequestOutput
from glm5_worker.engine.sequence import SamplingParams
from glm5_worker.parallel.replica import ReplicaFailure
from glm5_worker.runner.compiled import CompiledDecode
from glm5_worker.runner.threads import in_own_thread, settle
from glm5_worker.runner.weights import WeightSource, read_weights

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The served model as the engine has it now (weight_version and the fingerprint change with an update)."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    device: str
    weight_version: int
    tokenizer_fingerprint: str
    tensor_parallel_size: int
    expert_parallel: bool
    default_max_new_tokens: int
    collective_timeout_s: float
    max_update_bytes: int


class EngineStopped(Glm5Error):
    """The engine is shutting down and takes no new requests."""


class EngineFailure(Glm5Error):
    """The engine hit an internal error while running this request."""


class ReplicaLost(Glm5Error):
    """A rank of the replica failed: this worker serves nothing more and exits (its requests may be retried)."""


_Item = RequestOutput | Exception
_Sink = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[_Item]"]


def _deliver(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _send(deliveries: list[tuple[_Sink, _Item]]) -> None:
    """Hands a step's outputs to their event loops: one thread-safe wake-up per loop, not one per request
    (at batch 64 the per-request wake-ups cost more than the tokens' own messages)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = {}
    for (loop, q), item in deliveries:
        by_loop.setdefault(loop, []).append((q, item))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that caller's loop is closed: nobody is listening
            loop.call_soon_threadsafe(_deliver, items)


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """`b` appended to `a` (same request, same weight version): one message instead of two."""
    return RequestOutput(
        a.request_id,
        a.token_ids + b.token_ids,
        a.text + b.text,
        a.logprobs + b.logprobs,
        a.prompt_logprobs + b.prompt_logprobs,
        b.finish_reason,
        b.stop_reason,
        b.prompt_tokens,
        b.completion_tokens,
        b.cached_prompt_tokens,
        b.weight_version,
        b.error,
    )


class AsyncEngine:
    engine: Engine

    def __init__(
        self, build: Callable[[], Engine], on_fatal: Callable[[str], None] | None = None, begin: bool = True
    ) -> None:
        """Builds the engine with `build()` on the engine thread, from now on or (`begin` False) from begin();
        `started()` waits for it. `on_fatal(reason)` is called (on the engine thread) once the replica is lost."""
        self._on_fatal = on_fatal
        self._built: Future[Engine] = Future()
        self.fatal: str | None = None
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._accepting = True
        self._stop = threading.Event()
        # set, under the lock, when the engine thread stops taking commands: a command sent after that (or left
        # in the queue then) fails with EngineStopped instead of waiting for a thread that is gone
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=(build,), name="glm5-engine", daemon=True)
        if begin:
            self.begin()

    def begin(self) -> None:
        """Starts the engine thread, which builds the engine (the worker binds its port first)."""
        self._thread.start()

    @classmethod
    async def start(cls, build: Callable[[], Engine], on_fatal: Callable[[str], None] | None = None) -> AsyncEngine:
        """An engine thread with its engine built (the build's error, if it fails)."""
        self = cls(build, on_fatal)
        await self.started()
        return self

    async def started(self) -> Engine:
        """The built engine, once it is (the build's error if it failed)."""
        self.engine = await asyncio.wrap_future(self._built)
        return self.engine

    # engine thread ------------------------------------------------------------------------------------------
    def _run(self, build: Callable[[], Engine]) -> None:
        name_os_thread(self._thread.name)
        try:
            self._serve(build)
        finally:
            with self._lock:
                self._closed = True
                self._accepting = False
            while True:
                try:
                    _, fut = self._commands.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(EngineStopped("the engine is not running"))

    def _serve(self, build: Callable[[], Engine]) -> None:
        if settle(self._built, build) is not None or self._built.cancelled():  # nothing to serve with
            return
        self.engine = self._built.result()
        self._compile()
        while not self._stop.is_set():
            idle = not self.engine.has_work
            try:
                fn, fut = self._commands.get(timeout=0.05) if idle else self._commands.get_nowait()
            except queue.Empty:
                fn = None
            if fn is not None:
                self._execute(fn, fut)
                continue  # take every pending command before the next step
            if self.fatal is not None:
                continue
            if self.engine.has_work:
                self._step()
            else:
                try:
                    self.engine.idle()
                except ReplicaFailure as exc:
                    self._lose_replica(exc)

    def _compile(self) -> None:
        """Starts compiling the decode steps on a thread of their own (one that exits when they are built, taking
        its OpenMP pool with it); the engine takes them between two steps. Until then every step runs eagerly."""
        job = self.engine.compile_in_background()
        if job is None:
            return

        def done(fut: Future[CompiledDecode]) -> None:
            compiled = fut.result() if fut.exception() is None else None
            if compiled is None:
                log.error("compiling decode steps failed: %s", fut.exception())
            self.call(lambda: self.engine.use_compiled(compiled))  # between two steps

        in_own_thread(job, "glm5-compile").add_done_callback(done)

    def _execute(self, fn: Callable[[], Any], fut: Future[Any]) -> None:
        exc = settle(fut, fn)
        if isinstance(exc, ReplicaFailure) and self.fatal is None:
            self._lose_replica(exc)

    def _fail_all(self, error: Exception) -> None:
        failed: list[tuple[_Sink, _Item]] = []
        for out in self.engine.abort_all(str(error)):
            sink = self._sinks.pop(out.request_id, None)
            if sink:
                failed.append((sink, error))
        _send(failed)

    def _lose_replica(self, exc: ReplicaFailure) -> None:
        """Every request in flight ends UNAVAILABLE, nothing new is taken, and the server is told to exit."""
        log.error("replica lost: %s", exc)
        self.fatal = str(exc)
        self._accepting = False
        self._fail_all(ReplicaLost(f"the worker's replica failed: {exc}"))
        if self._on_fatal is not None:
            self._on_fatal(self.fatal)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except ReplicaFailure as exc:
            self._lose_replica(exc)
            return
        except Exception as exc:
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(EngineFailure(f"internal engine error: {exc}"))
            return
        deliveries: list[tuple[_Sink, _Item]] = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            deliveries.append((sink, out))
        _send(deliveries)

    # caller side --------------------------------------------------------------------------------------------
    def call(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(EngineStopped("the engine is not running"))
            else:
                self._commands.put((fn, fut))
        return fut

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    async def generate(
        self,
        request_id: str | None,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        add_special_tokens: bool = False,
        stream_interval: int = 1,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams one request's outputs; leaving the iterator early aborts the request. An output holds at
        least `stream_interval` tokens (the last one the rest), and outputs that queued up while the caller
        was busy are merged, so a slow caller gets fewer, larger messages instead of falling further behind."""
        if not self._accepting:
            raise EngineStopped("the worker is shutting down")
        outputs: asyncio.Queue[_Item] = asyncio.Queue()
        sink: _Sink = (asyncio.get_running_loop(), outputs)

        def add() -> str:
            seq = self.engine.add_request(request_id, prompt, prompt_token_ids, params, add_special_tokens)
            self._sinks[seq.request_id] = sink
            return seq.request_id

        rid = await self.run(add)
        finished = False
        held: RequestOutput | None = None
        try:
            while True:
                item = await outputs.get()
                while True:
                    if isinstance(item, Exception):
                        finished = True
                        raise item
                    finished = item.finished
                    if held is not None and held.weight_version != item.weight_version:
                        yield held  # every message carries the one version that produced its tokens
                        held = None
                    held = item if held is None else merge_outputs(held, item)
                    if finished or outputs.empty():
                        break
                    item = outputs.get_nowait()
                if finished or len(held.token_ids) >= stream_interval:
                    out, held = held, None
                    yield out
                if finished:
                    return
        finally:
            if not finished:
                self.call(lambda: self._abort(rid))

    def _abort(self, request_id: str) -> bool:
        self._sinks.pop(request_id, None)
        return self.engine.abort(request_id)

    # -- what a server reads of the engine (built by then: no RPC reaches the service before) -----------------

    @property
    def info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(
            served_model_name=e.served_model_name, max_model_len=e.max_model_len,
            vocab_size=e.model_config.vocab_size, eos_token_ids=list(e.eos_token_ids),
            dtype=str(e.dtype).removeprefix("torch."), device=str(e.device), weight_version=e.weight_version,
            tokenizer_fingerprint=e.tokenizer.fingerprint, tensor_parallel_size=e.tp.size,
            expert_parallel=e.tp.size > 1 and e.tp.expert_parallel,
            default_max_new_tokens=e.config.default_max_new_tokens,
            collective_timeout_s=e.config.collective_timeout_s, max_update_bytes=e.max_update_bytes,
        )  # fmt: skip

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self, after: tuple[int, int] | None = None) -> Future[EngineStats]:
        """The engine's stats, computed between steps; `after`: cache events since (epoch, seq)."""
        return self.call(functools.partial(self.engine.stats, after))

    async def update_weights(self, source: WeightSource, version: int, on_this_host: bool) -> tuple[float, float]:
        """Reads `version` from `source` on a thread of its own (every rank of the replica reads its shards
        meanwhile) and swaps it in on the engine thread: all ranks swap, or none does. Returns (read seconds,
        swap seconds); a read that fails is raised by the swap, after the other ranks were told."""
        e = self.engine
        start = time.perf_counter()
        await self.run(functools.partial(e.start_weight_update, source, version, on_this_host))
        new, failure = None, None
        try:
            read = functools.partial(read_weights, source, e.model_config, e.dtype, e.device, e.tokenizer.fingerprint,
                                     e.tp, "stored" if e.runner.model.mtp_layers else "skip")  # fmt: skip
            # a thread that ends with the read: a live executor thread that ran torch slows every step
            new = await asyncio.wrap_future(in_own_thread(read, "glm5-weights"))
        except (InvalidRequestError, CheckpointError, ConfigError) as exc:
            failure = exc
        load_s = time.perf_counter() - start
        swap_s = await self.run(functools.partial(e.swap_weights, new, version, failure))
        return load_s, float(swap_s)

    @property
    def draining(self) -> bool:
        """Takes no new requests (drain or shutdown began, or the replica was lost)."""
        return not self._accepting

    async def drain(self, grace: float) -> None:
        """Stops taking requests, lets running ones finish within `grace` seconds, aborts the rest."""
        self._accepting = False
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and await self.run(lambda: self.engine.has_work):
            await asyncio.sleep(0.02)
        await self.run(self._abort_all)

    def _abort_all(self) -> None:
        aborted: list[tuple[_Sink, _Item]] = []
        for out in self.engine.abort_all("shutdown"):
            sink = self._sinks.pop(out.request_id, None)
            if sink:
                aborted.append((sink, out))
        _send(aborted)

    def shutdown(self) -> None:
        self._accepting = False
        self._stop.set()
        if self._thread.ident is None:  # never begun: nothing was built
            return
        self._thread.join(timeout=5)
        if self._built.done() and self._built.exception() is None:
            self.engine.close()
