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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from glm5.errors import CapacityError, DeadlineError, InvalidRequestError, UnavailableError
from glm5.v1 import worker_pb2

from glm5_router.scheduling.dispatcher import Dispatcher, WorkerStatusError
from glm5_router.scheduling.job import Job
from glm5_router.workers.pool import WorkerPool

log = logging.getLogger(__name__)
SHORT, LONG = "queue:short", "queue:long"
MEDIUM_OFFSET = 1e12  # medium prompts sort after every short one in queue:short
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
        self.redis: aioredis.Redis = aioredis.from_url(settings.url)
        self.dispatcher = dispatcher
        self.pool = pool
        self.max_queued = max_queued
        self.long_pause_kv_usage = long_pause_kv_usage
        self._pop = self.redis.register_script(POP)
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.redis.ping()
        self._task = asyncio.create_task(self._consume())

    async def claim(self, key: str, seconds: float) -> bool:
        """True the first time `key` is claimed within `seconds`, across every router sharing this Redis."""
        return bool(await self.redis.set(f"glm5:sealed:{key}", 1, nx=True, px=max(1, int(seconds * 1000))))

    async def close(self, grace: float) -> None:
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
        meta = {
            "request": job.request.SerializeToString().hex(), "prompt_tokens": job.prompt_tokens,
            "max_new_tokens": job.max_new_tokens, "lane": job.lane, "affinity": job.affinity_key or "",
            "deadline": time.time() + max(0.0, job.deadline - time.monotonic()),
        }  # fmt: skip
        created = await self.redis.set(key, json.dumps(meta), nx=True, ex=int(self.settings.result_ttl_s))
        if created:
            queued = await self.redis.zcard(SHORT) + await self.redis.zcard(LONG)
            if queued >= self.max_queued:
                await self.redis.delete(key)
                raise CapacityError(f"the shared queue is full ({self.max_queued} requests); retry later")
            if job.lane == "long":
                await self.redis.zadd(LONG, {job.id: job.kv_cost})
            else:
                arrival = time.time() + (MEDIUM_OFFSET if job.lane == "medium" else 0.0)
                await self.redis.zadd(SHORT, {job.id: arrival})
        async for resp in self._relay(job):
            yield resp

    async def _relay(self, job: Job) -> AsyncIterator[worker_pb2.GenerateResponse]:
        stream, last = f"glm5:resp:{job.id}", "0-0"
        started = False
        while True:
            timeout = None if started else job.deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                raise DeadlineError("the request waited past its deadline in the shared queue")
            block_ms = int(1000 * min(timeout if timeout is not None else 5.0, 5.0)) or 1
            entries: Any = await self.redis.xread({stream: last}, count=64, block=block_ms)
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

    # -- the worker side: claim queued requests while this router has capacity ------------------------

    async def _consume(self) -> None:
        while True:
            try:
                if not await self._claim_one():
                    await asyncio.sleep(self.settings.poll_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("shared queue consumer failed")
                await asyncio.sleep(1.0)

    async def _claim_one(self) -> bool:
        workers = self.pool.routable()
        capacity = len(workers) * self.settings.claims_per_worker - len(self._running)
        if not workers or capacity <= 0:
            return False
        paused = min(w.kv_usage for w in workers) > self.long_pause_kv_usage
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
        request = worker_pb2.GenerateRequest()
        request.ParseFromString(bytes.fromhex(meta["request"]))
        remaining = float(meta["deadline"]) - time.time()
        job = Job(job_id, request, int(meta["prompt_tokens"]), int(meta["max_new_tokens"]), meta["lane"],
                  time.monotonic() + max(remaining, 0.0), meta["affinity"] or None)  # fmt: skip
        try:
            if remaining <= 0:
                raise DeadlineError("the request waited past its deadline in the shared queue")
            async for resp in self.dispatcher.submit(job):
                await self.redis.xadd(stream, {"r": resp.SerializeToString()})
            await self.redis.xadd(stream, {"end": "1"})
        except Exception as exc:  # the client sees it as its status code
            await self.redis.xadd(stream, _error_entry(exc))
        finally:
            await self.redis.expire(stream, int(self.settings.result_ttl_s))
