"""The rollout engines an RL run trains for: finding them (static addresses and a headless Service's records),
asking which answer and what each serves, numbering versions above what they already serve, and pushing each
published version to every live engine by the run's transport (glm5_trainer.versions, glm5_trainer.sync)."""

from __future__ import annotations

import asyncio
import collections
import datetime
import functools
import logging
from pathlib import Path

import grpc
from glm5.client import WorkerClient
from glm5.discovery import Discovery
from glm5.tokenizer import Tokenizer
from glm5.v1 import worker_pb2

from glm5_trainer.config import RLConfig
from glm5_trainer.ranks import Ranks
from glm5_trainer.sync import CollectiveSync, sync_engines
from glm5_trainer.versions import sync_workers

log = logging.getLogger(__name__)


class EngineFleet:
    """Rank 0's view of the engines. `counters` is the run's (engines_unreachable, push_failed)."""

    def __init__(self, config: RLConfig, ranks: Ranks, counters: collections.Counter[str]) -> None:
        self.c, self.ranks, self.versions, self.counters = config, ranks, ranks.versions, counters
        self.sync_seconds: list[float] = []
        self.last_sync_time: str | None = None  # when a version last reached the engines (UTC, RFC 3339)
        self.pushed_version: int | None = None  # the version the engines serve (None: not asked yet)
        self.engine_ranks: dict[str, int] = {}  # each live engine's tensor-parallel size (GetModelInfo)
        self._collective: CollectiveSync | None = None
        self.discovery = Discovery(config.engines, config.engine_dns, "rollout engines")

    async def engines(self) -> list[str]:
        return sorted(await self.discovery.addresses())

    async def live_engines(self) -> dict[str, int]:
        """The engines that answer, with the version each serves. One that does not (a worker restarting; it
        comes back under the Service and gets the next push) is skipped and counted, never fatal."""

        async def probe(address: str) -> tuple[str, int | None]:
            try:
                async with WorkerClient(address, self.c.tls, self.c.internal_token) as client:
                    info = await client.stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=10)
                self.engine_ranks[address] = max(1, int(info.tensor_parallel_size))
                return address, int(info.weight_version)
            except grpc.aio.AioRpcError as exc:
                log.warning("rollout engine %s does not answer (%s): skipped", address, exc.code().name)
                return address, None

        found = await asyncio.gather(*(probe(a) for a in await self.engines()))
        live = {a: v for a, v in found if v is not None}
        self.counters["engines_unreachable"] += len(found) - len(live)
        if not live:
            raise RuntimeError(f"no rollout engine answers (tried {[a for a, _ in found]})")
        return live

    async def adopt(self) -> None:
        """Engines that already serve a later version (a restarted trainer, a second run) only accept newer
        ones: continue numbering above the highest served version, and push the starting policy to them so
        every engine serves the weights this run's staleness accounting assumes."""
        served = max((await self.live_engines()).values())
        if served == self.versions.latest:
            self.pushed_version = served  # a fresh start on fresh engines, or a resume on ones serving it
            return
        self.versions.latest = max(served + 1, self.versions.latest)
        published = self.ranks.publish()
        self.ranks.save_state(self.versions.synced)
        await self.sync(published)
        log.info("engines served version %d: the starting policy is version %d", served, self.versions.latest)

    async def sync(self, path: Path) -> None:
        """Push a published version to every live engine; an engine that fails the push is counted and gets
        the next one (the samples it makes meanwhile carry its old version and the staleness filter sees it)."""
        version = self.versions.synced
        engines = list(await self.live_engines())
        results: list[dict[str, float] | BaseException]
        if self.c.weights_transport == "collective":
            results = await self._sync_collective(engines, version)
        else:
            results = await asyncio.gather(
                *(
                    sync_workers(
                        [e],
                        version,
                        path,
                        tls=self.c.tls,
                        admin_token=self.c.admin_token,
                        transport=self.c.weights_transport,
                        internal_token=self.c.internal_token,
                    )
                    for e in engines
                ),
                return_exceptions=True,
            )
        times = []
        for address, r in zip(engines, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("weight push of v%d to %s failed: %s", version, address, r)
                self.counters["push_failed"] += 1
            else:
                times.append(r[address])
        if not times:
            raise RuntimeError(f"the weight push of v{version} failed on every engine")
        self.sync_seconds.append(max(times))
        self.pushed_version = version
        self.last_sync_time = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    async def _sync_collective(self, engines: list[str], version: int) -> list[dict[str, float] | BaseException]:
        if self._collective is None:
            self._collective = CollectiveSync(self.c.sync_address, self.c.sync_port, self.c.sync_timeout_s,
                                              self.c.sync_bucket_bytes)  # fmt: skip
        targets = {e: self.engine_ranks.get(e, 1) for e in engines}
        return await sync_engines(self.ranks, self._collective, targets, version, self.policy_fingerprint,
                                  self.c.tls, self.c.admin_token, self.c.internal_token)  # fmt: skip

    @functools.cached_property
    def policy_fingerprint(self) -> str:
        """The policy's tokenizer, which an engine must serve to take a sync (ids would change meaning)."""
        return Tokenizer(self.c.policy).fingerprint if (self.c.policy / "tokenizer.json").is_file() else ""

    def close(self) -> None:
        """Stops listening for the collective's engines (the store's socket)."""
        if self._collective is not None:
            self._collective.close()
            self._collective = None
