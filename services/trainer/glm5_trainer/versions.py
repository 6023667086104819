"""Weight versions: actor_latest after every optimizer step, actor_synced published as a versioned safetensors
checkpoint every K steps and at least every sync interval (<= 1800 s), actor_ema kept alongside. Serving and
rollouts use actor_synced only: `sync_workers` pushes a published version to the workers (UpdateWeights naming
a shared folder, or PushWeights streaming its files) and reports how long it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist
from glm5.client import worker_stub
from glm5.security import NO_TLS, Secret, TlsConfig, admin_metadata
from glm5.security import channel as secure_channel
from glm5.serving import STREAM_ACCEPTED_KEY
from glm5.v1 import worker_pb2, worker_pb2_grpc

from glm5_trainer.distributed import write_checkpoint

MAX_SYNC_INTERVAL_S = 1800.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass
class WeightVersions:
    model: torch.nn.Module  # our GlmMoeDsaForCausalLM or transformers' (the trainer's autograd model)
    out_dir: Path
    tokenizer_dir: Path  # the policy checkpoint: its tokenizer ships with every published version
    sync_every_steps: int = 8
    sync_interval_s: float = 600.0
    ema_decay: float = 0.999
    clock: Callable[[], float] = time.monotonic
    latest: int = 0  # actor_latest: the version of the current weights (one more per optimizer step)
    synced: int = 0  # actor_synced: the last published version
    steps: int = 0  # optimizer steps the job has taken, across trainer restarts (recorded with every version)
    ema: dict[str, torch.Tensor] = field(default_factory=dict)
    _last_sync: float = 0.0
    written: dict[str, int] = field(default_factory=dict)  # this rank's part of the last publish

    def __post_init__(self) -> None:
        if self.sync_every_steps < 1 or not 0 < self.sync_interval_s <= MAX_SYNC_INTERVAL_S:
            raise ValueError(f"sync every >= 1 step and at least every {MAX_SYNC_INTERVAL_S:.0f} s")
        if not 0 < self.ema_decay < 1:
            raise ValueError("ema_decay must be in (0, 1)")
        self.ema = {k: v.detach().float().clone() for k, v in self.model.state_dict().items()}
        self._last_sync = self.clock()

    def synced_path(self, version: int) -> Path:
        return self.out_dir / "actor_synced" / f"v{version:06d}"

    @torch.no_grad()
    def after_step(self) -> Path | None:
        """Call after every optimizer step: bumps actor_latest, updates actor_ema, and publishes actor_synced
        when K steps or the sync interval have passed. Returns the published checkpoint, if any."""
        self.advance()
        return self.publish() if self.due() else None

    @torch.no_grad()
    def advance(self) -> None:
        """After an optimizer step: actor_latest moves on and actor_ema follows (each rank its own shards)."""
        self.latest += 1
        self.steps += 1
        for name, value in self.model.state_dict().items():
            self.ema[name].mul_(self.ema_decay).add_(value.detach().float(), alpha=1 - self.ema_decay)

    def due(self) -> bool:
        """K steps or the sync interval since the last published version (rank 0 decides for every rank)."""
        steps = self.latest - self.synced >= self.sync_every_steps
        return steps or self.clock() - self._last_sync >= self.sync_interval_s

    def publish(self) -> Path:
        """Write actor_synced at the current version (atomically: readers never see half a checkpoint). With
        several trainer ranks every rank calls it: each writes its files (distributed.write_checkpoint), rank 0
        the rest and the rename."""
        final = self.synced_path(self.latest)
        tmp = final.with_name(final.name + ".tmp")
        leader = not dist.is_initialized() or dist.get_rank() == 0
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier()  # the folder exists (on a volume every rank shares) before anyone writes into it
        self.written = write_checkpoint(self.model, tmp)
        if leader:
            config: Any = self.model.config  # both models carry their HF config
            (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
            for name in TOKENIZER_FILES:
                if (self.tokenizer_dir / name).is_file():
                    shutil.copy(self.tokenizer_dir / name, tmp / name)
            state = {"version": self.latest, "steps": self.steps, "ema_decay": self.ema_decay}
            (tmp / "version.json").write_text(json.dumps(state) + "\n")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        self.synced, self._last_sync = self.latest, self.clock()
        return final


def steps_recorded(checkpoint: Path) -> int | None:
    """The job's optimizer steps when this version was published (None: not recorded, or unreadable)."""
    try:
        steps = json.loads((checkpoint / "version.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) and steps >= 0 else None


TRANSPORTS = ("path", "stream", "collective")  # collective: glm5_trainer.sync
PUSH_CHUNK_BYTES = 4 << 20  # the worker's per-message limit (glm5_worker.server.push.MAX_CHUNK_BYTES)


async def sync_workers(workers: list[str], version: int, location: Path, timeout: float = 600.0,
                       tls: TlsConfig = NO_TLS, admin_token: Secret | None = None,
                       transport: str = "path", internal_token: Secret | None = None) -> dict[str, float]:  # fmt: skip
    """Pushes a published version to every worker in parallel; returns each worker's wall seconds (raises on a
    failure). transport "path": UpdateWeights names the folder, which the workers read from a volume they share
    with the trainer; "stream": PushWeights sends the folder's files over gRPC (nothing shared)."""
    files = await asyncio.to_thread(_manifest, location) if transport == "stream" else []

    async def one(address: str) -> tuple[str, float]:
        start = time.perf_counter()
        meta = admin_metadata(admin_token)
        async with secure_channel(address, tls) as ch:
            stub = worker_stub(ch, internal_token)
            if transport == "stream":
                await _push(stub, _chunks(location, version, files), timeout, meta)
            else:
                await stub.UpdateWeights(worker_pb2.UpdateWeightsRequest(version=version, location=str(location)),
                                         timeout=timeout, metadata=meta)  # fmt: skip
        return address, time.perf_counter() - start

    return dict(await asyncio.gather(*(one(w) for w in workers)))


async def _push(stub: worker_pb2_grpc.WorkerStub, chunks: AsyncIterator[worker_pb2.PushWeightsChunk],
                timeout: float, meta: tuple[tuple[str, str], ...]) -> None:  # fmt: skip
    """PushWeights: the header, then the data only once the worker has accepted the header (its initial
    metadata). A worker that refuses (not an admin caller, no --weights-root, a bad header, an old version)
    answers before reading on, and that answer is the error raised here; writing on into the refused call would
    fail with an INTERNAL error that hides it."""
    call = stub.PushWeights(timeout=timeout, metadata=meta)
    header = await anext(aiter(chunks))
    with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):  # refused at once: status below
        await call.write(header)
    if any(key == STREAM_ACCEPTED_KEY for key, _ in await call.initial_metadata()):
        try:
            async for chunk in chunks:
                await call.write(chunk)
            await call.done_writing()
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            pass  # the worker ended the call while this side wrote: its status below says why
    await call


def _manifest(folder: Path) -> list[worker_pb2.PushedFile]:
    out = []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(PUSH_CHUNK_BYTES):
                digest.update(block)
        out.append(worker_pb2.PushedFile(name=path.name, size=path.stat().st_size, sha256=digest.hexdigest()))
    return out


async def _chunks(folder: Path, version: int, files: list[worker_pb2.PushedFile]
                  ) -> AsyncIterator[worker_pb2.PushWeightsChunk]:  # fmt: skip
    yield worker_pb2.PushWeightsChunk(header=worker_pb2.PushWeightsHeader(version=version, files=files))
    for f in files:
        with open(folder / f.name, "rb") as handle:
            while block := await asyncio.to_thread(handle.read, PUSH_CHUNK_BYTES):
                yield worker_pb2.PushWeightsChunk(data=block)
