"""The TitoGateway service: rollout ledgers, routing to rollout engines, heartbeats, tokenizer fingerprints,
and rollout records to the buffer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
from glm5.client import worker_stub
from glm5.discovery import Discovery
from glm5.errors import ConfigError, InvalidRequestError
from glm5.rl.buffer import RolloutBuffer
from glm5.security import NO_TLS, Secret, TlsConfig
from glm5.security import channel as secure_channel
from glm5.serving import DEFAULT_CONNECTIONS, ConnectionLimits
from glm5.settings import derived, setting
from glm5.v1 import common_pb2, tito_pb2, tito_pb2_grpc, worker_pb2, worker_pb2_grpc

from glm5_tito.ledger import Ledger
from glm5_tito.routing import BoundedRing, rollout_key

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("context.abort raises")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The gateway's settings; each field's flag (`glm5 tito-gateway --help`) is declared with it (glm5.settings)."""

    engines: tuple[str, ...] = setting((), name="engine", repeat=True, help="rollout engine (worker) host:port, "
                                       "repeatable")  # fmt: skip
    engine_dns: str | None = setting(None, help="host:port of a headless Service; every A record is a rollout "
                                     "engine (a rank)")  # fmt: skip
    tokenizer_fingerprint: str | None = setting(None, help="sha256 every engine must report (the job's; default: "
                                                "the first engine's)")  # fmt: skip
    vnodes: int = setting(64, name="virtual-nodes", help="ring points per rank")
    virtual_node_reserve: float = setting(0.2, help="share of virtual nodes held back on the hash ring for "
                                          "under-loaded ranks")  # fmt: skip
    load_bound: float = setting(1.25, help="no rank above ceil(c * load / ranks)")
    heartbeat_s: float = setting(1.0, name="heartbeat-interval", help="seconds between model-info checks of each "
                                 "engine")  # fmt: skip
    missed_heartbeats: int = setting(3, help="a rank that misses this many checks in a row is removed and its "
                                     "rollouts re-homed")  # fmt: skip
    max_rollouts: int = setting(100000, help="rollouts open at once; more are refused (RESOURCE_EXHAUSTED)")
    tls: TlsConfig = derived(NO_TLS, why="--tls-* (glm5.security): served over TLS, and used to reach the engines")
    internal_token: Secret | None = derived(None, why="--internal-token-file / -env: sent to the engines with every "
                                            "call (their --internal-token-*)")  # fmt: skip
    connections: ConnectionLimits = derived(DEFAULT_CONNECTIONS, why="the --grpc-* connection flags (glm5.serving): "
                                            "what one connection to the gateway may hold")  # fmt: skip

    def __post_init__(self) -> None:
        if not self.engines and not self.engine_dns:
            raise ConfigError("the gateway needs rollout engines: --engine host:port (repeatable) or --engine-dns")
        fp = self.tokenizer_fingerprint
        if fp is not None and (len(fp) != 64 or any(c not in "0123456789abcdef" for c in fp)):
            raise ConfigError("--tokenizer-fingerprint must be a sha256 in hex (64 characters)")
        if self.vnodes < 1 or not 0 <= self.virtual_node_reserve < 1 or self.load_bound < 1:
            raise ConfigError("--virtual-nodes >= 1, 0 <= --virtual-node-reserve < 1, --load-bound >= 1")
        if self.heartbeat_s <= 0 or self.missed_heartbeats < 1 or self.max_rollouts < 1:
            raise ConfigError("--heartbeat-interval > 0, --missed-heartbeats >= 1, --max-rollouts >= 1")


@dataclass(eq=False)
class Engine:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    fingerprint: str = ""
    missed: int = 0
    excluded: str = ""


@dataclass
class Gateway(tito_pb2_grpc.TitoGatewayServicer):
    config: GatewayConfig
    buffer: RolloutBuffer
    ring: BoundedRing = field(init=False)
    engines: dict[str, Engine] = field(default_factory=dict)
    ledgers: dict[str, Ledger] = field(default_factory=dict)
    fingerprint: str | None = None
    discovery: Discovery = field(init=False)
    _task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        c = self.config
        self.ring = BoundedRing(c.vnodes, c.virtual_node_reserve, c.load_bound)
        self.discovery = Discovery(c.engines, c.engine_dns, "rollout engines")
        self.fingerprint = c.tokenizer_fingerprint

    # -- engines and heartbeats -----------------------------------------------------------------------

    async def start(self) -> None:
        await self._heartbeat_all()
        self._task = asyncio.create_task(self._heartbeats())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(e.channel.close() for e in self.engines.values()), return_exceptions=True)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            await self._heartbeat_all()

    async def _discover(self) -> None:
        # engines that left are kept: heartbeats take them out of rotation, and bring them back if they return
        for address in await self.discovery.addresses() - set(self.engines):
            channel = secure_channel(address, self.config.tls)
            self.engines[address] = Engine(address, channel, worker_stub(channel, self.config.internal_token))

    async def _heartbeat_all(self) -> None:
        await self._discover()
        await asyncio.gather(*(self._heartbeat(e) for e in self.engines.values()))

    async def _heartbeat(self, e: Engine) -> None:
        try:
            info = await e.stub.GetModelInfo(
                worker_pb2.GetModelInfoRequest(), timeout=max(0.5, self.config.heartbeat_s)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED and e.missed == 0:  # a configuration error: once
                log.error("rank %s refuses the gateway's calls (UNAUTHENTICATED): give the gateway the engines' "
                          "internal token (--internal-token-file / --internal-token-env)", e.address)  # fmt: skip
            e.missed += 1
            if e.missed >= self.config.missed_heartbeats and e.address in self.ring.loads:
                log.warning("rank %s missed %d heartbeats: removed, its rollouts re-home", e.address, e.missed)
                self.ring.remove_rank(e.address)
            return
        e.missed = 0
        e.fingerprint = info.tokenizer_fingerprint
        if self.fingerprint is None:
            self.fingerprint = e.fingerprint
        if e.fingerprint != self.fingerprint:
            if not e.excluded:
                e.excluded = (f"tokenizer fingerprint {e.fingerprint[:12]}... differs from the job's "
                              f"{self.fingerprint[:12]}...")  # fmt: skip
                log.error("rank %s refused: %s", e.address, e.excluded)
            self.ring.remove_rank(e.address)
            return
        if e.address not in self.ring.loads:
            log.info("rank %s joined", e.address)
            self.ring.add_rank(e.address)
            self.ring.rebalance()

    # -- RPCs -----------------------------------------------------------------------------------------

    async def Turn(
        self, request: tito_pb2.TurnRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tito_pb2.TurnResponse]:
        if not request.rollout_id:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "rollout_id: required")
        if not request.context_token_ids:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "context_token_ids: required")
        if request.stream_interval < 0:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "stream_interval: must be >= 0")
        ledger = self.ledgers.get(request.rollout_id)
        if ledger is None:
            if len(self.ledgers) >= self.config.max_rollouts:
                await _abort(
                    context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.config.max_rollouts} rollouts are open"
                )
            ledger = Ledger(request.rollout_id, rollout_key(request.rollout_id), request.group_id)
        elif request.group_id and request.group_id != ledger.group_id:
            message = f"group_id: rollout {request.rollout_id!r} belongs to group {ledger.group_id!r}"
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, message)
        try:
            ledger.extend_context(list(request.context_token_ids))
        except InvalidRequestError as exc:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self.ledgers[request.rollout_id] = ledger
        for attempt in range(2):  # a rank that vanished: re-home once (the next rank re-prefills)
            try:
                rank = self.ring.lookup(ledger.key)
            except LookupError:
                await _abort(
                    context, grpc.StatusCode.UNAVAILABLE, "no rollout engine with the job's tokenizer is available"
                )
            ledger.rank = rank
            engine = self.engines[rank]
            turn_id = f"{request.rollout_id}-t{len(ledger.turn_versions)}"
            req = worker_pb2.GenerateRequest(prompt_token_ids=ledger.tokens, sampling=request.sampling,
                                             return_logprobs=True, request_id=turn_id,
                                             stream_interval=request.stream_interval)  # fmt: skip
            sent, version = 0, 0
            try:
                async for r in engine.stub.Generate(req):
                    lps = [lp.logprob for lp in r.logprobs]
                    if r.token_ids:
                        version = r.weight_version
                        ledger.add_generated(list(r.token_ids), lps, r.weight_version)
                        sent += len(r.token_ids)
                    yield tito_pb2.TurnResponse(token_ids=r.token_ids, logprobs=lps, weight_version=r.weight_version,
                                                rank=rank, finish_reason=r.finish_reason)  # fmt: skip
                ledger.turn_versions.append(version)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
                    await _abort(context, exc.code(), exc.details() or "")
                if sent or attempt:
                    await _abort(context, grpc.StatusCode.UNAVAILABLE,
                                        f"rank {rank} failed during the turn ({exc.code().name}); the ledger keeps the "
                                        f"{sent} tokens already streamed")  # fmt: skip
                log.warning("rank %s failed before the turn started (%s): re-homing", rank, exc.code().name)
                self.ring.remove_rank(rank)

    async def FinishRollout(
        self, request: tito_pb2.FinishRolloutRequest, context: grpc.aio.ServicerContext
    ) -> tito_pb2.RolloutRecord:
        ledger = self.ledgers.pop(request.rollout_id, None)
        if ledger is None:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"rollout_id: unknown rollout {request.rollout_id!r}")
        if request.status == tito_pb2.ROLLOUT_STATUS_UNSPECIFIED:
            self.ledgers[request.rollout_id] = ledger
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "status: completed, truncated, aborted or failed")
        self.ring.release(ledger.key)
        record = self._record(ledger)
        record.reward, record.status = request.reward, request.status
        await self.buffer.put(record)
        return record

    async def GetRollout(
        self, request: tito_pb2.GetRolloutRequest, context: grpc.aio.ServicerContext
    ) -> tito_pb2.RolloutRecord:
        ledger = self.ledgers.get(request.rollout_id)
        if ledger is None:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"rollout_id: unknown rollout {request.rollout_id!r}")
        return self._record(ledger)

    async def GetRouting(
        self, request: tito_pb2.GetRoutingRequest, context: grpc.aio.ServicerContext
    ) -> tito_pb2.RoutingState:
        ranks = [tito_pb2.RankState(address=a, rollouts=self.ring.loads.get(a, 0), alive=a in self.ring.loads,
                                    tokenizer_fingerprint=e.fingerprint, excluded=e.excluded)
                 for a, e in sorted(self.engines.items())]  # fmt: skip
        return tito_pb2.RoutingState(ranks=ranks, overflow_moves=self.ring.overflow_moves, rehomed=self.ring.rehomed)

    async def TakeRollouts(
        self, request: tito_pb2.TakeRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> tito_pb2.TakeRolloutsResponse:
        if request.max_records < 1 or request.timeout_ms < 0:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "max_records >= 1 and timeout_ms >= 0 required")
        records = await self.buffer.take(request.max_records, request.timeout_ms / 1000)
        return tito_pb2.TakeRolloutsResponse(records=records)

    @staticmethod
    def _record(ledger: Ledger) -> tito_pb2.RolloutRecord:
        return tito_pb2.RolloutRecord(
            rollout_id=ledger.rollout_id, rollout_key=ledger.key, group_id=ledger.group_id, token_ids=ledger.tokens,
            loss_mask=ledger.mask, logprobs=ledger.logprobs, token_versions=ledger.token_versions,
            turn_versions=ledger.turn_versions, prompt_tokens=ledger.prompt_tokens,
        )  # fmt: skip


__all__ = ["Gateway", "GatewayConfig", "common_pb2"]
