"""The workers the router knows: a static list and/or the A records of a headless Service, each with a gRPC
channel, its latest stats, its load and a circuit breaker. A poll loop keeps health and stats fresh: a
worker whose GetStats fails is taken out of rotation and comes back when it answers again."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from glm5.client import worker_stub
from glm5.discovery import Discovery
from glm5.security import channel as secure_channel
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from glm5_router.config import RouterConfig
from glm5_router.workers.breaker import CircuitBreaker, State
from glm5_router.workers.cache_index import CacheIndex
from glm5_router.workers.stream import WorkerStream

log = logging.getLogger(__name__)
# A channel whose worker cannot be reached (not started yet, loading, restarting) retries its connection after a
# backoff, and fails calls at once in between. gRPC's default backoff grows 1.6x per attempt up to 120 s: a worker
# that came up after a minute or more away was taken back up to two minutes late (2m16s in issue 34). Here it
# retries every second at most, so a poll reaches a worker within about a second of it listening again.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(eq=False)
class Worker:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    breaker: CircuitBreaker
    healthy: bool = False
    stats: worker_pb2.WorkerStats | None = None
    info: worker_pb2.ModelInfo | None = None
    outstanding_tokens: int = 0  # sum of max_new_tokens of requests assigned and not finished
    in_flight: int = 0
    cache_block_size: int = 0  # tokens per block of its prefix-cache events; 0 until it reports any
    excluded: str = ""  # why it is never used (tokenizer mismatch)
    refused: bool = False  # its last answer was UNAUTHENTICATED (the router lacks the internal token): logged once
    requests: WorkerStream = field(init=False)  # Generate requests, multiplexed over one stream

    def __post_init__(self) -> None:
        self.requests = WorkerStream(self.stub, self.address)

    @property
    def kv_usage(self) -> float:
        return float(self.stats.kv_usage) if self.stats is not None else 0.0

    @property
    def draining(self) -> bool:
        """It said it is shutting down: it finishes its requests, gets no new ones."""
        return self.stats is not None and self.stats.draining

    @property
    def routable(self) -> bool:
        return self.healthy and not self.excluded and not self.draining and self.breaker.current() is not State.OPEN


@dataclass
class WorkerPool:
    config: RouterConfig
    workers: dict[str, Worker] = field(default_factory=dict)
    tokenizer: Tokenizer | None = None
    model_info: worker_pb2.ModelInfo | None = None
    on_change: Callable[[], None] = lambda: None  # the dispatcher's wake-up
    on_breaker: Callable[[str, State, str], None] = lambda address, state, reason: None
    cache_index: CacheIndex | None = None  # --routing kv: which worker holds which prefix blocks
    discovery: Discovery = field(init=False)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.discovery = Discovery(self.config.workers, self.config.worker_dns, "workers")
        if self.config.routing == "kv" and self.cache_index is None:
            self.cache_index = CacheIndex(self.config.cache_index_blocks)

    async def start(self) -> None:
        await self._discover()
        await self._poll_all()
        self._tasks = [asyncio.create_task(self._discovery_loop()), asyncio.create_task(self._poll_loop())]

    async def wait_ready(self, timeout: float | None) -> bool:
        """True once one worker answered (healthy) and the tokenizer is known; None waits as long as it takes."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)
        return self._ready.is_set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def routable(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.routable]

    def may_eject(self, address: str) -> bool:
        """Whether `address` may be taken out of rotation: at least max(1, (1 - max ejection share) x pool) other
        workers stay healthy and closed (Envoy's max_ejection_percent, but never emptying the pool)."""
        pool = [w for w in self.workers.values() if not w.excluded]
        others = [w for w in pool if w.address != address and w.healthy and w.breaker.state is State.CLOSED]
        keep = max(1, math.ceil((1 - self.config.breaker.max_ejection_percent / 100) * len(pool)))
        return len(others) >= keep

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await asyncio.gather(*(w.channel.close() for w in self.workers.values()), return_exceptions=True)

    # -- discovery ------------------------------------------------------------------------------------

    async def _discover(self) -> None:
        want = await self.discovery.addresses()
        for address in want - set(self.workers):
            channel = secure_channel(address, self.config.tls, CHANNEL_OPTIONS)
            self.workers[address] = Worker(
                address,
                channel,
                worker_stub(channel, self.config.internal_token),  # every call carries the internal token
                CircuitBreaker(
                    self.config.breaker,
                    on_transition=self._breaker_hook(address),
                    may_eject=functools.partial(self.may_eject, address),
                ),
            )
            log.info("worker %s added", address)
        for address in set(self.workers) - want:
            worker = self.workers.pop(address)
            if self.cache_index is not None:
                self.cache_index.drop(address)
            log.info("worker %s removed (no longer discovered)", address)
            worker.requests.drain()
            await worker.channel.close(grace=30)  # in-flight requests may finish
        self.on_change()

    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval_s)
            try:
                await self._discover()
            except Exception:
                log.exception("worker discovery failed")

    def _breaker_hook(self, address: str) -> Callable[[State, str], None]:
        def hook(state: State, reason: str) -> None:
            log.warning("worker %s breaker %s: %s", address, state.value, reason)
            self.on_breaker(address, state, reason)

        return hook

    # -- health and stats -----------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            try:
                await self._poll_all()
            except Exception:  # e.g. a tokenizer that does not load: log it, keep polling the others
                log.exception("worker poll failed")

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values())))

    async def _poll(self, worker: Worker) -> None:
        timeout = max(0.5, self.config.stats_interval_s)
        try:
            stats = await worker.stub.GetStats(self._stats_request(worker), timeout=timeout)
            if worker.info is None:
                info = await worker.stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=timeout)
                # info is recorded only once the tokenizer is adopted: a worker whose GetTokenizer failed is asked
                # again at the next poll instead of turning healthy while the pool still has no tokenizer
                await self._adopt_tokenizer(worker, info, timeout)
                worker.info = info
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and worker.healthy and await self._serving(worker):
                return  # busy, not sick: its health service answers; the last stats stand
            refused = exc.code() == grpc.StatusCode.UNAUTHENTICATED
            if refused and not worker.refused:  # a configuration error, not a worker starting up: say so once
                log.error("worker %s refuses the router's calls (UNAUTHENTICATED): give the router the workers' "
                          "internal token (--internal-token-file / --internal-token-env)", worker.address)  # fmt: skip
            worker.refused = refused
            if worker.healthy:
                log.warning("worker %s unhealthy: %s %s", worker.address, exc.code().name, exc.details())
                self.on_change()
            worker.healthy = False
            return
        if stats.HasField("cache_events") and self.cache_index is not None:
            self.cache_index.apply(worker.address, stats.cache_events)
            worker.cache_block_size = stats.cache_events.block_size
            stats.ClearField("cache_events")  # a snapshot can be large: the index has it now
        was_draining = worker.draining
        worker.stats, worker.refused = stats, False
        if stats.draining != was_draining:
            log.info("worker %s %s", worker.address, "draining: no new requests" if stats.draining else "serving again")
            self.on_change()
        worker.breaker.observe(stats)
        if not worker.healthy:
            log.info("worker %s healthy", worker.address)
            worker.healthy = True
            self.on_change()
        if self.tokenizer is not None and not worker.excluded:
            self._ready.set()  # after `healthy`: whoever waits for ready finds a routable worker

    def _stats_request(self, worker: Worker) -> worker_pb2.GetStatsRequest:
        if self.cache_index is None:
            return worker_pb2.GetStatsRequest()
        epoch, seq = self.cache_index.cursor(worker.address)
        return worker_pb2.GetStatsRequest(cache_events=True, cache_epoch=epoch, cache_seq=seq)

    async def _serving(self, worker: Worker) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(worker.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=max(0.5, self.config.stats_interval_s)
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def _adopt_tokenizer(self, worker: Worker, info: worker_pb2.ModelInfo, timeout: float) -> None:
        if self.tokenizer is None:
            files = await worker.stub.GetTokenizer(worker_pb2.GetTokenizerRequest(), timeout=timeout * 10)
            self.tokenizer = Tokenizer.from_files(files.tokenizer_json, files.tokenizer_config_json, worker.address)
            self.model_info = info
            log.info("serving %s (tokenizer %s...) from %s", info.served_model_name,
                     self.tokenizer.fingerprint[:12], worker.address)  # fmt: skip
        elif info.tokenizer_fingerprint != self.tokenizer.fingerprint:
            worker.excluded = (
                f"tokenizer fingerprint {info.tokenizer_fingerprint[:12]}... differs from the pool's "
                f"{self.tokenizer.fingerprint[:12]}..."
            )
            log.error("worker %s excluded: %s", worker.address, worker.excluded)
