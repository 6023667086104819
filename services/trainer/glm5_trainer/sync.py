"""The collective weight-sync transport, the trainer's side (glm5.weight_sync has the wire format).

Rank 0 hosts the rendezvous store and roots one group per engine replica and sync. Every trainer rank walks the
policy's state dict in one order and gathers each sharded entry (a DTensor's full_tensor, a collective they all
join); rank 0 alone keeps it, under its on-disk names (experts split per expert, as published), packs it into
the current bucket and broadcasts each full bucket to every group while the next is gathered. So rank 0 holds
two buckets plus the entry being gathered, never the whole model, and no file is written or read.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from glm5.client import worker_stub
from glm5.model.loader import on_disk
from glm5.security import NO_TLS, Secret, TlsConfig, admin_metadata
from glm5.security import channel as secure_channel
from glm5.v1 import worker_pb2
from glm5.weight_sync import NAMES, Manifest, Sender, TensorSpec, plan_buckets, send
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from glm5_trainer.ranks import Ranks

log = logging.getLogger(__name__)
DEFAULT_BUCKET_BYTES = 256 << 20


def _entries(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return sorted(model.state_dict().items())


def manifest(model: nn.Module, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Manifest:
    """What a sync of `model` sends, from the global shapes alone (nothing gathered)."""
    config: Any = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    specs = []
    for name, t in _entries(model):
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        for key, part in on_disk(name, meta, int(config.moe_intermediate_size)).items():
            if not (tied and key == "lm_head.weight"):
                specs.append(TensorSpec(key, tuple(part.shape), NAMES[part.dtype]))
    return Manifest(version, plan_buckets(specs, bucket_bytes))


def gathered(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every on-disk tensor, whole, in manifest order, on rank 0 (every rank must run it: the gathers are
    collectives; the others yield nothing)."""
    config: Any = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    leader = not dist.is_initialized() or dist.get_rank() == 0
    for name, t in _entries(model):
        t = t.detach()
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if leader:
            for key, part in on_disk(name, full, int(config.moe_intermediate_size)).items():
                if not (tied and key == "lm_head.weight"):
                    yield key, part


def buckets(model: nn.Module, plan: Manifest) -> Iterator[list[torch.Tensor]]:
    """The manifest's buckets, filled from `gathered` (rank 0)."""
    source = gathered(model)
    for bucket in plan.buckets:
        out = []
        for spec in bucket:
            key, tensor = next(source)
            if key != spec.name:
                raise RuntimeError(f"weight sync: gathered {key} where the manifest has {spec.name}")
            out.append(tensor)
        yield out
    for _ in source:  # drives any gathers left (none when the manifest matches)
        pass


class CollectiveSync:
    """Rank 0's sync endpoint, kept for the trainer's lifetime (one store, a fresh group per replica and sync)."""

    def __init__(self, address: str, port: int, timeout_s: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.sender = Sender(address, port, timeout_s)
        self.bucket_bytes = bucket_bytes
        log.info("weight sync: the engines rendezvous at %s", self.sender.rendezvous)

    @property
    def rendezvous(self) -> str:
        return self.sender.rendezvous

    def open(self, targets: dict[str, tuple[str, int, threading.Event]]) -> tuple[dict[str, Any], dict[str, str]]:
        """Each target's group ({engine: (group name, size, set when the engine's call ended)}), and the errors
        of those that did not join."""
        groups: dict[str, Any] = {}
        failed: dict[str, str] = {}
        for engine, (name, size, ended) in targets.items():
            try:
                groups[engine] = self.sender.group(name, size, ended.is_set)
            except RuntimeError as exc:
                failed[engine] = str(exc)
        return groups, failed

    def close(self) -> None:
        self.sender.close()


async def sync_engines(ranks: Ranks, sync: CollectiveSync, engines: dict[str, int], version: int,
                       fingerprint: str = "", tls: TlsConfig = NO_TLS, admin_token: Secret | None = None,
                       internal_token: Secret | None = None) -> list[dict[str, float] | BaseException]:  # fmt: skip
    """Rank 0: the current weights to every engine ({address: its tensor-parallel size}) over a group each,
    while each engine's SyncWeights call waits for its replica to swap. Per engine, in order: its wall seconds,
    or the error its call ended with (one engine's failure leaves the others' syncs alone)."""
    tag = f"glm5-sync/{secrets.token_hex(16)}/v{version}"  # unguessable: only the engines called join
    targets = {e: (f"{tag}/{i}", 1 + tp, threading.Event()) for i, (e, tp) in enumerate(engines.items())}

    async def call(engine: str) -> dict[str, float]:
        name, size, ended = targets[engine]
        start = time.perf_counter()
        request = worker_pb2.SyncWeightsRequest(
            version=version, rendezvous=sync.rendezvous, group=name, world_size=size,
            tokenizer_fingerprint=fingerprint, timeout_seconds=sync.sender.timeout_s,
        )  # fmt: skip
        try:
            async with secure_channel(engine, tls) as ch:
                await worker_stub(ch, internal_token).SyncWeights(
                    request, timeout=sync.sender.timeout_s * 4, metadata=admin_metadata(admin_token)
                )
        finally:
            ended.set()  # an engine that refused never joins: rank 0 stops waiting for it
        return {engine: time.perf_counter() - start}

    calls = [asyncio.create_task(call(e)) for e in engines]
    failed = await asyncio.to_thread(ranks.sync_weights, sync, version, targets)
    for engine, error in failed.items():
        log.warning("weight sync of v%d to %s: the broadcast failed: %s", version, engine, error)
    return list(await asyncio.gather(*calls, return_exceptions=True))


def send_weights(model: nn.Module, plan: Manifest, groups: dict[str, Any]) -> dict[str, str]:
    """Rank 0: the buckets to every group (the other ranks run `gathered` alongside); the failed groups' errors."""
    return send(groups, plan, buckets(model, plan))
