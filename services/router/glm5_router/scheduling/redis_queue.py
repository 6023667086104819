"""The shared queue: Redis sorted sets `queue:short` (FIFO by arrival; medium prompts after short ones) and
`queue:long` (by estimated KV cost), so several router replicas share one queue and queued requests outlive
a router restart.

- A request is stored under `glm5:req:<id>` (the worker request and its scheduling fields) and its id added
  to a sorted set. Any router with spare worker capacity pops it (ZPOPMIN: exactly one router gets it),
  runs it through its own dispatcher and appends every response to the stream `glm5:resp:<id>`.
- The router the client is connected to relays that stream. If that router went away (a restart), the
  request still runs once; the client gets its output by sending the same request id again
  (X-Request-Id / request_id), which attaches to the existing stream instead of queueing a duplicate.
- Results are kept for `result_ttl_s`, then the id can be used afresh.
- A request whose client leaves, or that fails on the client's router (deadline, no worker, Redis unreachable), is
  abandoned: taken out of the queue if no router claimed it yet (its id is free again), otherwise marked
  `glm5:cancel:<id>`, which the router running it checks while it streams and then cancels the worker's job.
  A router that is shutting down abandons nothing: its clients come back with their ids.
- Every blocking read waits at most `block_s`, well under the connection's `socket_timeout_s`, so a long wait for a
  token is never a socket timeout; an unreachable Redis is retried for `outage_s`, then answered UNAVAILABLE (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import redis.asyncio as aioredis
from glm5.errors import CapacityError, DeadlineError, InvalidRequestError, UnavailableError
from glm5.v1 import worker_pb2
from redis.exceptions import RedisError

from glm5_router.scheduling.dispatcher import Dispatcher, WorkerStatusError
from glm5_router.scheduling.job import Job
from glm5_router.scheduling.queues import LONG, SHORT, lane_score, long_paused
from glm5_router.workers.pool import WorkerPool

log = logging.getLogger(__name__)
T = TypeVar("T")
# Pop from the short queue, else from the long one unless it is paused: one atomic step.
POP = """
local r = redis.call('ZPOPMIN', KEYS[1])
if r[1] == nil and ARGV[1] == '0' then r = redis.call('ZPOPMIN', KEYS[2]) end
return r[1]
"""


@dataclass(frozen=True, slots=True)
class RedisSettings:
    url: str
    result_ttl_s: float = 3600.0
    claims_per_worker: int = 8  # requests this router takes from the shared queue per routable worker
    poll_s: float = 0.05
    block_s: float = 1.0  # longest blocking read (XREAD BLOCK) ...
    socket_timeout_s: float = 10.0  # ... well under the connection's read timeout (redis-py's default is 5 s)
    outage_s: float = 10.0  # how long an unreachable Redis is retried before a request fails UNAVAILABLE
    cancel_check_s: float = 0.5  # how often a router running a request looks for its client's cancel mark
    no_worker_timeout_s: float = 10.0  # an unclaimed request with no routable worker here fails 503 after this

    def __post_init__(self) -> None:
        if not 0 < self.block_s < self.socket_timeout_s:
            raise ValueError("the blocking read must be shorter than the socket timeout")


def _error_entry(exc: BaseException) -> dict[Any, Any]:
    kinds: dict[type[BaseException], str] = {InvalidRequestError: "invalid", WorkerStatusError: "invalid",
                                             CapacityError: "capacity", DeadlineError: "deadline"}  # fmt: skip
    return {"error": kinds.get(type(exc), "unavailable"), "message": str(exc)}


def _raise(entry: dict[str, str]) -> None:
    kind, message = entry.get("error"), entry.get("message", "")
    if kind == "invalid":
        raise InvalidRequestError("request", message)
    if kind == "capacity":
        raise CapacityError(message)
    if kind == "deadline":
        raise DeadlineError(message)
    raise UnavailableError(message)


class SharedQueue:
    def __init__(self, settings: RedisSettings, dispatcher: Dispatcher, pool: WorkerPool, max_queued: int,
                 long_pause_kv_usage: float) -> None:  # fmt: skip
        self.settings = settings
        self.redis: aioredis.Redis = aioredis.from_url(
            settings.url, socket_timeout=settings.socket_timeout_s, socket_connect_timeout=settings.socket_timeout_s,
            health_check_interval=30,
        )  # fmt: skip
        self.dispatcher = dispatcher
        self.pool = pool
        self.max_queued = max_queued
        self.long_pause_kv_usage = long_pause_kv_usage
        self._pop = self.redis.register_script(POP)
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._abandoning: set[asyncio.Task[None]] = set()
        self.closing = False  # set first thing on shutdown: relays cut by it abandon nothing

    async def start(self) -> None:
        await self.redis.ping()
        self._task = asyncio.create_task(self._consume())

    async def claim(self, key: str, seconds: float) -> bool:
        """True the first time `key` is claimed within `seconds`, across every router sharing this Redis."""
        return bool(await self.redis.set(f"glm5:sealed:{key}", 1, nx=True, px=max(1, int(seconds * 1000))))

    async def close(self, grace: float) -> None:
        self.closing = True
        if self._abandoning:
            await asyncio.wait(self._abandoning, timeout=grace)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._running:  # claimed jobs finish (or are cut at the grace period)
            await asyncio.wait(self._running, timeout=grace)
        await self.redis.aclose()

    # -- the client side: enqueue (or attach) and relay the result stream -------------------------------

    async def submit(self, job: Job) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
        key = f"glm5:req:{job.id}"
        entry = json.dumps(job.shared_entry())  # once: a retried write must not move the deadline
        created = await self._retried(lambda: self.redis.set(key, entry, nx=True, ex=int(self.settings.result_ttl_s)))
        if created:
            await self._enqueue(job, key)
        finished = False
        try:
            async for resp in self._relay(job):
                yield resp
            finished = True
        finally:
            if not finished and not self.closing:  # the client left or its request failed here: stop the work
                task = asyncio.get_running_loop().create_task(self._abandon(job.id))
                self._abandoning.add(task)
                task.add_done_callback(self._abandoning.discard)

    async def _enqueue(self, job: Job, key: str) -> None:
        queued = await self._retried(self._depth)
        if queued >= self.max_queued:
            await self._retried(lambda: self.redis.delete(key))
            raise CapacityError(f"the shared queue is full ({self.max_queued} requests); retry later")
        queue, score = lane_score(job, time.time())  # wall clock: router replicas share the queue
        await self._retried(lambda: self.redis.zadd(queue, {job.id: score}))

    async def _depth(self) -> int:
        return int(await self.redis.zcard(SHORT)) + int(await self.redis.zcard(LONG))

    async def _abandon(self, job_id: str) -> None:
        """Take an abandoned request out of the queue (its id is free again) or, once claimed, mark it cancelled."""
        try:
            removed = await self.redis.zrem(SHORT, job_id) + await self.redis.zrem(LONG, job_id)
            if removed:
                await self.redis.delete(f"glm5:req:{job_id}")
            else:
                await self.redis.set(f"glm5:cancel:{job_id}", 1, ex=int(self.settings.result_ttl_s))
        except RedisError as exc:  # the request runs on; its output expires unread
            log.warning("could not abandon %s in the shared queue: %s", job_id, type(exc).__name__)

    async def _retried(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call` until it succeeds or Redis stayed unreachable for `outage_s`: then UNAVAILABLE (503)."""
        since = time.monotonic()
        delay = 0.05
        while True:
            try:
                return await call()
            except RedisError as exc:
                if time.monotonic() - since >= self.settings.outage_s:
                    raise UnavailableError(f"the shared queue (Redis) is unreachable: {type(exc).__name__}; "
                                           "retry later") from None  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)

    async def _relay(self, job: Job) -> AsyncIterator[worker_pb2.GenerateResponse]:
        stream, last = f"glm5:resp:{job.id}", "0-0"
        started = False
        no_worker_since: float | None = None
        while True:
            now = time.monotonic()
            if self.closing:  # the request stays queued (or runs on where it was claimed) for the client's return
                raise UnavailableError(f"the router is stopping; send request {job.id!r} again (X-Request-Id) to "
                                       "get its output")  # fmt: skip
            if not started:
                if now >= job.deadline:
                    raise DeadlineError("the request waited past its deadline in the shared queue")
                no_worker_since = None if self.pool.routable() else (no_worker_since or now)
                waited = now - no_worker_since if no_worker_since is not None else 0.0
                if waited >= self.settings.no_worker_timeout_s and await self._retried(partial(self._unqueue, job.id)):
                    raise UnavailableError(
                        f"no worker is available (down, restarting or ejected) after "
                        f"{self.settings.no_worker_timeout_s:g}s; retry later"
                    )
            wait = self.settings.block_s if started else min(self.settings.block_s, job.deadline - now)
            read = partial(self.redis.xread, {stream: last}, count=64, block=max(1, int(1000 * wait)))
            entries: Any = await self._retried(read)
            if not entries and not await self._retried(partial(self.redis.exists, f"glm5:req:{job.id}")):
                raise UnavailableError("the request was lost by the shared queue (Redis restarted); retry")
            for _, items in entries or []:
                for entry_id, fields in items:
                    last = entry_id
                    data = {k.decode(): v for k, v in fields.items()}
                    if "r" in data:
                        started = True
                        resp = worker_pb2.GenerateResponse()
                        resp.ParseFromString(data["r"])
                        yield resp
                    elif "error" in data:
                        _raise({k: v.decode() for k, v in data.items()})
                    elif "end" in data:
                        return

    async def _unqueue(self, job_id: str) -> bool:
        """True when `job_id` was still queued (no router claimed it) and is now removed with its request."""
        removed = await self.redis.zrem(SHORT, job_id) + await self.redis.zrem(LONG, job_id)
        if removed:
            await self.redis.delete(f"glm5:req:{job_id}")
        return bool(removed)

    # -- the worker side: claim queued requests while this router has capacity ------------------------

    async def _consume(self) -> None:
        failing = False
        while True:
            try:
                claimed = await self._claim_one()
                if failing:
                    log.info("shared queue reachable again")
                    failing = False
                if not claimed:
                    await asyncio.sleep(self.settings.poll_s)
            except asyncio.CancelledError:
                raise
            except RedisError as exc:  # an outage: one line, then quiet retries until it is back
                if not failing:
                    log.warning("shared queue unreachable (%s): retrying", type(exc).__name__)
                failing = True
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("shared queue consumer failed")
                await asyncio.sleep(1.0)

    async def _claim_one(self) -> bool:
        workers = self.pool.routable()
        capacity = len(workers) * self.settings.claims_per_worker - len(self._running)
        if not workers or capacity <= 0:
            return False
        paused = long_paused(workers, self.long_pause_kv_usage)
        raw = await self._pop(keys=[SHORT, LONG], args=["1" if paused else "0"])
        if raw is None:
            return False
        job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
        meta_raw = await self.redis.get(f"glm5:req:{job_id}")
        if meta_raw is None:
            return True  # expired while queued
        task = asyncio.create_task(self._run(job_id, json.loads(meta_raw)))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return True

    async def _run(self, job_id: str, meta: dict[str, Any]) -> None:
        stream = f"glm5:resp:{job_id}"
        job = Job.from_shared_entry(job_id, meta)
        try:
            if job.deadline <= time.monotonic():
                raise DeadlineError("the request waited past its deadline in the shared queue")
            checked = time.monotonic()
            async with contextlib.aclosing(self.dispatcher.submit(job)) as responses:
                async for resp in responses:
                    await self._retried(partial(self.redis.xadd, stream, {"r": resp.SerializeToString()}))
                    if time.monotonic() - checked >= self.settings.cancel_check_s:
                        checked = time.monotonic()
                        if await self._cancelled(job_id):
                            break  # leaving the stream cancels the worker's job
                else:
                    await self._retried(lambda: self.redis.xadd(stream, {"end": "1"}))
                    return
            log.info("request %s cancelled: its client left", job_id)
            await self._retried(lambda: self.redis.xadd(stream, {"error": "cancelled", "message": "cancelled"}))
        except UnavailableError as exc:
            if "shared queue" in str(exc):  # Redis itself is gone: nobody can read an error entry either
                log.warning("request %s stopped: %s", job_id, exc)
                return
            await self._write_error(stream, exc)
        except Exception as exc:  # the client sees it as its status code
            await self._write_error(stream, exc)
        finally:
            with contextlib.suppress(RedisError):
                await self.redis.expire(stream, int(self.settings.result_ttl_s))

    async def _cancelled(self, job_id: str) -> bool:
        try:
            return bool(await self.redis.exists(f"glm5:cancel:{job_id}"))
        except RedisError:
            return False  # cannot tell: keep serving

    async def _write_error(self, stream: str, exc: BaseException) -> None:
        try:
            await self._retried(lambda: self.redis.xadd(stream, _error_entry(exc)))
        except UnavailableError:
            log.warning("could not record the error of %s: the shared queue is unreachable", stream)
