"""Dispatch: take jobs off the queues, pick a worker, batch per worker, stream, retry.

Batching: a worker's pending batch is sent when the sum of its jobs' max_new_tokens reaches the token budget,
when its oldest job has waited --max-wait-ms, or at once when the worker is idle (nothing in flight). A job
whose stream fails before any token reached the client is retried on another worker (bounded, jittered
exponential backoff); a stream that fails after tokens were sent ends with UNAVAILABLE, never a duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc
from glm5.errors import DeadlineError, InvalidRequestError, UnavailableError
from glm5.v1 import worker_pb2
from opentelemetry.trace import SpanKind, Status, StatusCode

from glm5_router.config import RouterConfig
from glm5_router.scheduling.job import Job
from glm5_router.scheduling.queues import InProcessQueues, long_paused
from glm5_router.telemetry import Telemetry
from glm5_router.workers.picker import Picker
from glm5_router.workers.pool import Worker, WorkerPool

log = logging.getLogger(__name__)
NO_WORKER_POLL_S = 0.25  # how often a job checks for a worker while none is routable
POOL_CHECK_S = 1.0  # ... and while some are (busy)
FAILING_AFTER = 5  # dispatch failures in a row after which /health reports the dispatcher as failing
# Worker answers that are the client's fault: passed through, not a worker failure, not retried.
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}


class WorkerStatusError(Exception):
    """A worker answered with a client-error status: relayed to the client as is."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass
class Batch:
    jobs: list[Job] = field(default_factory=list)
    tokens: int = 0
    since: float = 0.0


class Dispatcher:
    def __init__(
        self, config: RouterConfig, pool: WorkerPool, queues: InProcessQueues, telemetry: Telemetry | None = None
    ) -> None:
        self.config = config
        self.telemetry = telemetry or Telemetry()
        self.pool = pool
        self.queues = queues
        self._wake = asyncio.Event()
        self._batches: dict[str, Batch] = {}
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.picker = Picker(config, pool.cache_index)
        self.retries = 0
        self.batches_sent = 0
        self.failures = 0  # dispatch errors since start (a job failed alone, or a loop round)
        self.failures_in_a_row = 0
        self.last_failure = ""

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- the client side ------------------------------------------------------------------------------

    async def submit(self, job: Job) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
        """Queue `job` and stream its responses; raises CapacityError, DeadlineError, UnavailableError or
        WorkerStatusError. The dispatcher only decides when and where; the caller's own coroutine streams
        from the worker, so a token costs no extra hop. Leaving the iteration early cancels the job."""
        job.assigned = asyncio.get_running_loop().create_future()
        self.queues.put(job)
        self._dispatch()  # inline: an idle worker takes the job without a trip through the dispatch loop
        if not job.assigned.done():
            self._wake.set()
        try:
            while True:
                worker = await self._assignment(job)
                try:
                    async with contextlib.aclosing(self._stream(worker, job)) as stream:
                        async for resp in stream:
                            yield resp
                    return
                except _Retry:
                    continue
        finally:
            self._cancel(job)

    async def _assignment(self, job: Job) -> Worker:
        """The worker the dispatcher gives `job`. Busy workers are waited for until the job's deadline; with no
        routable worker at all (down, restarting, ejected) the job waits --no-worker-timeout, then fails
        UNAVAILABLE (503) instead of sitting in the queue until its deadline."""
        assert job.assigned is not None
        no_worker_since: float | None = None
        while not job.assigned.done():
            now = time.monotonic()
            if self.pool.routable():
                no_worker_since = None
            else:
                no_worker_since = now if no_worker_since is None else no_worker_since
                if now - no_worker_since >= self.config.no_worker_timeout_s:
                    raise UnavailableError(
                        f"no worker is available (down, restarting or ejected) after "
                        f"{self.config.no_worker_timeout_s:g}s; retry later"
                    )
            if now >= job.deadline:
                raise DeadlineError(
                    f"the request waited {now - job.arrival:.1f}s without being served (deadline); "
                    f"the workers are busy or unavailable"
                )
            # wake at the deadline, and often enough to notice the pool emptying (a worker that died)
            wait = min(job.deadline - now, NO_WORKER_POLL_S if no_worker_since is not None else POOL_CHECK_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(job.assigned), max(wait, 0.0))
        worker = job.assigned.result()
        if job.attempts == 0:
            self.telemetry.queue_wait.observe(time.monotonic() - job.arrival)
        return worker

    async def _stream(self, worker: Worker, job: Job) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
        job.attempts += 1
        outcome: bool | None = True
        span = self.telemetry.tracer.start_span(
            "glm5.v1.Worker/Generate", kind=SpanKind.CLIENT, context=job.trace_context,
            attributes={"rpc.system": "grpc", "server.address": worker.address, "glm5.attempt": job.attempts},
        )  # fmt: skip
        stream = worker.requests.generate(job.request)
        try:
            async for resp in stream:
                job.started = True
                yield resp
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code in CLIENT_CODES:
                raise WorkerStatusError(code, details) from None
            outcome = code == grpc.StatusCode.RESOURCE_EXHAUSTED  # busy, not sick
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))
            await self._failed(worker, job, f"{code.name}: {details}")
            raise _Retry() from None
        except (asyncio.CancelledError, GeneratorExit):
            outcome = None if not job.started else True  # the client left: no evidence about the worker
            raise
        finally:
            span.end()
            await stream.aclose()  # no-op when it finished; frees the worker's slot when the client left
            self._release(worker, job)
            if outcome is None:
                worker.breaker.forget()
            else:
                worker.breaker.record(outcome)

    def _cancel(self, job: Job) -> None:
        if job.done:
            return
        self.queues.discard(job)
        job.done = True
        if job.assigned is not None and not job.assigned.done():
            job.assigned.cancel()

    # -- the dispatch loop ----------------------------------------------------------------------------

    async def _loop(self) -> None:
        self.pool.on_change = self._wake.set
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.stats_interval_s)
            self._wake.clear()
            try:
                self._dispatch()
                self._flush_due()
            except Exception as exc:  # the loop outlives any error: queued work must not be stranded
                self._record_failure(exc)
                log.exception("dispatch round failed")

    @property
    def failing(self) -> bool:
        """Every recent dispatch attempt failed: /health says so instead of 'ok'."""
        return self.failures_in_a_row >= FAILING_AFTER

    def _record_failure(self, exc: BaseException) -> None:
        self.failures += 1
        self.failures_in_a_row += 1
        self.last_failure = type(exc).__name__
        self.telemetry.dispatch_failures.inc()

    def _dispatch(self) -> None:
        workers = self.pool.routable()
        paused = long_paused(workers, self.config.long_pause_kv_usage)
        while True:
            job = self.queues.peek(paused)
            if job is None:
                return
            candidates = [w for w in workers if w.address not in job.failed_on] or workers
            try:
                worker = self.picker.pick(candidates, job)
            except Exception as exc:  # this job's own fault or not: it fails alone, the queue goes on
                self.queues.pop(job)
                self._fail(job, exc)
                continue
            if worker is None:
                return  # every worker refuses now: wait for a change or the next tick
            self.queues.pop(job)
            self._assign(worker, job)
            self.failures_in_a_row = 0

    def _fail(self, job: Job, exc: Exception) -> None:
        """End one job with `exc` (its client sees it) without touching any other."""
        self._record_failure(exc)
        log.error("dispatching %s failed: %s", job.id, type(exc).__name__, exc_info=exc)
        job.done = True
        if job.assigned is not None and not job.assigned.done():
            job.assigned.set_exception(exc)

    def _assign(self, worker: Worker, job: Job) -> None:
        worker.in_flight += 1
        worker.outstanding_tokens += job.max_new_tokens
        job.worker = worker.address
        batch = self._batches.setdefault(worker.address, Batch())
        if not batch.jobs:
            batch.since = time.monotonic()
        batch.jobs.append(job)
        batch.tokens += job.max_new_tokens
        busy = worker.in_flight > len(batch.jobs)  # something of this worker is already running
        idle = not busy and self.config.flush_when_idle
        if batch.tokens >= self.config.token_budget or idle or self.config.max_wait_ms == 0:
            self._send(worker, batch)
        else:
            self._arm_timer(batch.since + self.config.max_wait_ms / 1000)

    def _flush_due(self) -> None:
        now = time.monotonic()
        for address, batch in list(self._batches.items()):
            worker = self.pool.workers.get(address)
            if batch.jobs and worker is not None and now - batch.since >= self.config.max_wait_ms / 1000:
                self._send(worker, batch)
        pending = [b.since for b in self._batches.values() if b.jobs]
        if pending:
            self._arm_timer(min(pending) + self.config.max_wait_ms / 1000)

    def _arm_timer(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, at - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(delay, self._wake.set)

    def _send(self, worker: Worker, batch: Batch) -> None:
        jobs, batch.jobs, batch.tokens = batch.jobs, [], 0
        self.batches_sent += 1
        for job in jobs:
            if job.done or job.assigned is None or job.assigned.done():
                self._release(worker, job)
                continue
            job.assigned.set_result(worker)

    def _release(self, worker: Worker, job: Job) -> None:
        worker.in_flight -= 1
        worker.outstanding_tokens -= job.max_new_tokens
        if len(self.queues) or any(b.jobs for b in self._batches.values()):
            self._wake.set()  # a freed worker may take queued work or flush its batch

    # -- failures -------------------------------------------------------------------------------------

    async def _failed(self, worker: Worker, job: Job, why: str) -> None:
        """Raises the error the client sees, or returns after a backoff with the job queued again."""
        job.failed_on.add(worker.address)
        if job.started:
            raise UnavailableError(
                f"worker {worker.address} failed mid-stream ({why}); the output so far was sent and is not "
                f"repeated: retry the request"
            )
        if job.attempts > self.config.max_retries or time.monotonic() >= job.deadline:
            raise UnavailableError(
                f"no worker could serve the request after {job.attempts} attempts (last: {worker.address}: {why})"
            )
        self.retries += 1
        self.telemetry.retries.inc()
        backoff = self.config.retry_backoff_ms / 1000 * (2 ** (job.attempts - 1))
        delay = random.uniform(0, backoff)  # full jitter
        log.info("retrying %s in %.0f ms after %s failed: %s", job.id, delay * 1000, worker.address, why)
        await asyncio.sleep(delay)
        job.affinity_key = None  # do not insist on the worker that just failed
        job.assigned = asyncio.get_running_loop().create_future()
        self.queues.put(job, front=True)
        self._wake.set()


class _Retry(Exception):
    """The job went back to the queue after a failure before its first token."""


def validate_job_fits(job: Job, max_model_len: int) -> None:
    if job.prompt_tokens + job.max_new_tokens > max_model_len:
        raise InvalidRequestError(
            "max_new_tokens",
            f"prompt ({job.prompt_tokens} tokens) + max_new_tokens ({job.max_new_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens",
        )
