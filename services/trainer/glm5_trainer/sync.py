"""The collective weight-sync transport, the trainer's side (glm5.weight_sync has the wire format).

Rank 0 hosts the rendezvous store and waits for each engine replica's ranks to arrive; then every trainer rank
joins one group per replica and sends each engine rank, point to point, the rows its own FSDP2 shard holds
(Shard(0): torch.chunk's rows of dim 0, so a stacked-experts entry gives each rank whole experts) of what that
engine rank asked for of each tensor (glm5.weight_sync: the part its shard reads), bucket by bucket, under the
tensors' on-disk names (experts split per expert, as published). Nothing
is gathered: each rank holds two segments of a bucket beside its shard, the bytes leave every rank in parallel,
and no file is written or read.
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
from glm5.client import worker_stub
from glm5.model.loader import on_disk
from glm5.security import NO_TLS, Secret, TlsConfig, admin_metadata
from glm5.security import channel as secure_channel
from glm5.v1 import worker_pb2
from glm5.weight_sync import NAMES, Group, Manifest, Sender, TensorSpec, join_group, plan_buckets, send
from torch import nn
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
    from glm5_trainer.ranks import Ranks

log = logging.getLogger(__name__)
DEFAULT_BUCKET_BYTES = 256 << 20


def _entries(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return sorted(model.state_dict().items())


def _chunks(rows: int, senders: int) -> list[tuple[int, int]]:
    """torch.chunk's split of `rows` over `senders` (FSDP2's Shard(0)): (sender, rows), empty ones left out."""
    size = -(-rows // senders) if rows else 0
    return [(s, min(size, rows - s * size)) for s in range(senders) if s * size < rows]


def _sharded(t: torch.Tensor, senders: int) -> bool:
    if not isinstance(t, DTensor):
        return False
    if t.device_mesh.size() != senders or tuple(t.placements) != (Shard(0),):
        mesh = t.device_mesh.size()
        raise NotImplementedError(f"weight sync: a parameter placed {t.placements} on a mesh of {mesh} ranks "
                                  f"(only Shard(0) over the {senders} senders)")  # fmt: skip
    return True


Parts = tuple[tuple[int, int], ...]


def layout(name: str, t: torch.Tensor, senders: int, moe_intermediate_size: int) -> list[tuple[str, Any, Parts]]:
    """An entry's on-disk tensors: (name, its meta tensor, which senders hold its rows): the entry itself split
    as its shard is, or one expert of a stacked entry, whole on the rank that holds that expert."""
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    rows = t.shape[0] if t.dim() else 1
    held = _chunks(rows, senders) if _sharded(t, senders) else [(0, rows)]
    pieces = on_disk(name, meta, moe_intermediate_size)
    if list(pieces) == [name]:
        return [(name, meta, tuple(held))]
    per_expert = len(pieces) // rows  # a stacked entry: on_disk gives each expert's pieces in expert order
    owner = [s for s, n in held for _ in range(n)]
    return [(key, part, ((owner[i // per_expert], part.shape[0] if part.dim() else 1),))
            for i, (key, part) in enumerate(pieces.items())]  # fmt: skip


def manifest(model: nn.Module, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES, senders: int = 1) -> Manifest:
    """What a sync of `model` from `senders` ranks sends, and which rank sends which rows (nothing gathered)."""
    config: Any = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    specs = []
    for name, t in _entries(model):
        for key, part, parts in layout(name, t, senders, int(config.moe_intermediate_size)):
            if not (tied and key == "lm_head.weight"):
                specs.append(TensorSpec(key, tuple(part.shape), NAMES[part.dtype], parts))
    return Manifest(version, plan_buckets(specs, bucket_bytes), senders)


def held(model: nn.Module, rank: int, senders: int) -> dict[str, torch.Tensor]:
    """The rows of each on-disk tensor that this rank holds (views of its shard: nothing is copied)."""
    config: Any = model.config
    out: dict[str, torch.Tensor] = {}
    for name, t in _entries(model):
        entry = layout(name, t, senders, int(config.moe_intermediate_size))
        if _sharded(t, senders):
            local = t.detach().to_local()  # type: ignore[attr-defined]
            mine = dict(_chunks(t.shape[0], senders)).get(rank, 0)
            if local.shape[0] != mine:
                raise RuntimeError(f"weight sync: {name} has {local.shape[0]} rows here, torch.chunk gives {mine}")
        elif rank == 0:
            local = t.detach()
        else:
            continue
        if len(entry) == 1 and entry[0][0] == name:
            out[name] = local
            continue
        keys = [key for key, _, parts in entry if parts[0][0] == rank]  # this rank's experts, in order
        for key, value in zip(keys, on_disk(name, local, int(config.moe_intermediate_size)).values(), strict=True):
            out[key] = value
    return out


def pieces(model: nn.Module, plan: Manifest, rank: int) -> Iterator[list[torch.Tensor]]:
    """This rank's tensors of each bucket, in manifest order (what glm5.weight_sync.send packs)."""
    mine = held(model, rank, plan.senders)
    for bucket in plan.buckets:
        yield [mine[spec.name] for spec in bucket if any(s == rank for s, _ in spec.pieces)]


class CollectiveSync:
    """Rank 0's sync endpoint, kept for the trainer's lifetime (one store, a fresh group per replica and sync)."""

    def __init__(self, address: str, port: int, timeout_s: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.sender = Sender(address, port, timeout_s)
        self.bucket_bytes = bucket_bytes
        log.info("weight sync: the engines rendezvous at %s", self.sender.rendezvous)

    @property
    def rendezvous(self) -> str:
        return self.sender.rendezvous

    @property
    def timeout_s(self) -> float:
        return self.sender.timeout_s

    def wait(self, targets: dict[str, tuple[str, int, threading.Event]],
             senders: int) -> tuple[dict[str, tuple[str, int]], dict[str, str]]:  # fmt: skip
        """The targets whose engine ranks are all joining ({engine: (group name, size)}), and the errors of those
        that are not ({engine: (name, size, set when the engine's call ended)} in)."""
        ready: dict[str, tuple[str, int]] = {}
        failed: dict[str, str] = {}
        for engine, (name, size, ended) in targets.items():
            try:
                self.sender.wait_engines(name, senders, size, ended.is_set)
                ready[engine] = (name, size)
            except RuntimeError as exc:
                failed[engine] = str(exc)
        return ready, failed

    def close(self) -> None:
        self.sender.close()


def open_groups(ready: dict[str, tuple[str, int]], rank: int, senders: int, rendezvous: str, timeout_s: float,
                sync: CollectiveSync | None = None) -> tuple[dict[str, Group], dict[str, str]]:  # fmt: skip
    """This trainer rank's groups, in the same order on every rank (rank 0 through its own store, `sync`)."""
    groups: dict[str, Group] = {}
    failed: dict[str, str] = {}
    for engine, (name, size) in ready.items():
        try:
            if sync is not None:
                groups[engine] = sync.sender.group(name, senders, size)
            else:
                groups[engine] = join_group(rendezvous, name, rank, senders, size, timeout_s)
        except RuntimeError as exc:
            failed[engine] = str(exc)
    return groups, failed


def send_weights(model: nn.Module, plan: Manifest, groups: dict[str, Group], rank: int) -> dict[str, str]:
    """This rank's rows of every bucket to every group; the failed groups' errors."""
    return send(groups, rank, plan, pieces(model, plan, rank))


async def sync_engines(ranks: Ranks, sync: CollectiveSync, engines: dict[str, int], version: int,
                       fingerprint: str = "", tls: TlsConfig = NO_TLS, admin_token: Secret | None = None,
                       internal_token: Secret | None = None) -> list[dict[str, float] | BaseException]:  # fmt: skip
    """Rank 0: the current weights to every engine ({address: its tensor-parallel size}) over a group each,
    while each engine's SyncWeights call waits for its replica to swap. Per engine, in order: its wall seconds,
    or the error its call ended with (one engine's failure leaves the others' syncs alone)."""
    tag = f"glm5-sync/{secrets.token_hex(16)}/v{version}"  # unguessable: only the engines called join
    senders = ranks.world.size
    targets = {e: (f"{tag}/{i}", senders + tp, threading.Event()) for i, (e, tp) in enumerate(engines.items())}

    async def call(engine: str) -> dict[str, float]:
        name, size, ended = targets[engine]
        start = time.perf_counter()
        request = worker_pb2.SyncWeightsRequest(
            version=version, rendezvous=sync.rendezvous, group=name, world_size=size, senders=senders,
            tokenizer_fingerprint=fingerprint, timeout_seconds=sync.timeout_s,
        )  # fmt: skip
        try:
            async with secure_channel(engine, tls) as ch:
                await worker_stub(ch, internal_token).SyncWeights(
                    request, timeout=sync.timeout_s * 4, metadata=admin_metadata(admin_token)
                )
        finally:
            ended.set()  # an engine that refused never joins: rank 0 stops waiting for it
        return {engine: time.perf_counter() - start}

    calls = [asyncio.create_task(call(e)) for e in engines]
    failed = await asyncio.to_thread(ranks.sync_weights, sync, version, targets)
    for engine, error in failed.items():
        log.warning("weight sync of v%d to %s failed: %s", version, engine, error)
    return list(await asyncio.gather(*calls, return_exceptions=True))
