"""Weight sync over a collective: a version's tensors broadcast in buckets from the trainer to every rank of an
engine replica, without a file and without a whole copy anywhere.

One group per replica and sync, rendezvoused through a TCP store the trainer's rank 0 hosts: the trainer is
rank 0, the replica's ranks 1..N. The trainer first broadcasts the manifest (JSON: the tensors' on-disk names,
shapes and dtypes, bucket by bucket; never pickle, which would run a peer's code), then each bucket as one
flat byte buffer. Each engine rank unpacks a bucket into views and hands them to the loader, which copies the
slices this rank's tensor/expert-parallel layout holds, so a rank holds its shard plus two buckets (one
arriving, one being read).

gloo carries the bytes (host tensors, over TCP). A root that dies closes its sockets and every receiver's wait
fails at once; a silent one is bounded by the group's timeout.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from glm5.errors import CheckpointError

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_BUCKET_BYTES = 4 << 30  # what one bucket may make a receiver allocate
MAX_MANIFEST_BYTES = 256 << 20
MAX_TENSORS = 4_000_000
GROUP_NAME = re.compile(r"^[A-Za-z0-9._/-]{1,160}$")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,300}$")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, F16

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True, slots=True)
class Manifest:
    version: int
    buckets: tuple[tuple[TensorSpec, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for b in self.buckets for t in b)

    def dtypes(self) -> dict[str, str]:
        return {t.name: t.dtype for b in self.buckets for t in b}

    def to_bytes(self) -> bytes:
        buckets = [[[t.name, list(t.shape), t.dtype] for t in b] for b in self.buckets]
        return json.dumps({"version": self.version, "buckets": buckets}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, max_bucket_bytes: int = MAX_BUCKET_BYTES) -> Manifest:
        """A peer's manifest, checked: known dtypes, sane names and shapes, no name twice, buckets bounded."""
        try:
            raw = json.loads(data)
            version, buckets_raw = int(raw["version"]), raw["buckets"]
            buckets = tuple(
                tuple(TensorSpec(str(n), tuple(int(d) for d in shape), str(dt)) for n, shape, dt in b)
                for b in buckets_raw
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"weight sync: the manifest is malformed: {exc}") from exc
        seen: set[str] = set()
        for bucket in buckets:
            for t in bucket:
                if not _NAME.match(t.name) or t.name in seen:
                    raise CheckpointError(f"weight sync: bad or repeated tensor name {t.name[:80]!r}")
                if t.dtype not in DTYPES or len(t.shape) > 8 or any(d < 0 for d in t.shape):
                    raise CheckpointError(f"weight sync: tensor {t.name} has dtype {t.dtype} or shape {t.shape}")
                seen.add(t.name)
            size = layout(bucket)[1]
            if size > max_bucket_bytes:
                raise CheckpointError(f"weight sync: a bucket of {size} bytes is over the {max_bucket_bytes} limit")
        if len(seen) > MAX_TENSORS:
            raise CheckpointError(f"weight sync: {len(seen)} tensors is over the {MAX_TENSORS} limit")
        return cls(version, buckets)


def layout(bucket: Sequence[TensorSpec]) -> tuple[list[int], int]:
    """Each tensor's byte offset in its bucket's buffer, and the buffer's size: offsets aligned to 8 bytes, so
    every tensor is a view of the buffer whatever dtypes came before it."""
    offsets, used = [], 0
    for spec in bucket:
        offsets.append(used)
        used += -(-spec.nbytes // 8) * 8
    return offsets, used


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> tuple[tuple[TensorSpec, ...], ...]:
    """Consecutive tensors grouped into buckets of at most `bucket_bytes` (a larger tensor travels alone)."""
    buckets: list[list[TensorSpec]] = []
    used = 0
    for spec in specs:
        if not buckets or (buckets[-1] and used + spec.nbytes > bucket_bytes):
            buckets.append([])
            used = 0
        buckets[-1].append(spec)
        used += spec.nbytes
    return tuple(tuple(b) for b in buckets)


class Received:
    """A tensor of a received bucket, read as the loader reads a file's (loader.TensorSource)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> str:
        return NAMES[self.tensor.dtype]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor:
        return self.tensor[index] if index else self.tensor


def route_address(host: str, port: int) -> str:
    """This host's address on the route to host:port (what a peer there can reach us at); no packet is sent."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return host, int(port)


def _group(store: Any, name: str, rank: int, size: int, timeout_s: float, hostname: str) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(PrefixStore(name, store), rank, size, opts)


class Sender:
    """The trainer's side: hosts the rendezvous store on address:port (0: any free port) and roots the groups."""

    def __init__(self, address: str, port: int = 0, timeout_s: float = 120.0) -> None:
        self.address, self.timeout_s = address, timeout_s
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._listener = socket.socket(family)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((address, port))  # only there: the store would listen on every interface itself
        self._listener.listen(512)
        self.port = int(self._listener.getsockname()[1])
        self._store = TCPStore(
            address, self.port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
            master_listen_fd=self._listener.fileno(),
        )  # fmt: skip

    @property
    def rendezvous(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    def group(self, name: str, size: int, abandoned: Callable[[], bool] = lambda: False) -> Any:
        """Rank 0 of the group `name` of `size` ranks, once the others are joining. Raises after the timeout, or
        as soon as `abandoned()` says they never will (the engine refused the sync)."""
        keys = [f"{name}/ready/{r}" for r in range(1, size)]
        deadline = time.monotonic() + self.timeout_s
        while not self._store.check(keys):
            if abandoned():
                raise RuntimeError("the engine did not take the sync")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine's ranks did not join within {self.timeout_s:.0f}s")
            time.sleep(0.02)
        return _group(self._store, name, 0, size, self.timeout_s, self.address)

    def close(self) -> None:
        self._listener.close()


def send(groups: dict[str, Any], manifest: Manifest, buckets: Iterator[Sequence[torch.Tensor]]) -> dict[str, str]:
    """Broadcasts the manifest, then every bucket (its tensors in manifest order), to every group at once.
    A group that fails is dropped and the rest go on; returns the failed groups' errors. `buckets` is consumed
    whole even when every group failed (the trainer's ranks gather each bucket together).

    Two buffers, reused: bucket k goes out in the background (gloo's own threads) while bucket k+1 is gathered
    and packed, so the trainer's gathers and the engines' receives overlap; at most two buckets in memory."""
    header = manifest.to_bytes()
    failed: dict[str, str] = {}

    def start(tensor: torch.Tensor) -> dict[str, Any]:
        works = {}
        for key, pg in groups.items():
            if key not in failed:
                try:
                    works[key] = pg.broadcast(tensor, 0)
                except RuntimeError as exc:
                    failed[key] = str(exc)
        return works

    def finish(works: dict[str, Any]) -> None:
        for key, work in works.items():
            try:
                work.wait()
            except RuntimeError as exc:
                failed.setdefault(key, str(exc))

    finish(start(torch.tensor([len(header)], dtype=torch.int64)))
    finish(start(torch.frombuffer(bytearray(header), dtype=torch.uint8)))
    largest = max((layout(b)[1] for b in manifest.buckets), default=0)
    buffers: list[torch.Tensor] = []
    pending: list[dict[str, Any]] = [{}, {}]
    for k, (specs, tensors) in enumerate(zip(manifest.buckets, buckets, strict=True)):
        slot = k % 2
        finish(pending[slot])  # the buffer's previous bucket has left
        if len(buffers) <= slot:
            buffers.append(torch.empty(largest, dtype=torch.uint8))
        offsets, size = layout(specs)
        flat = buffers[slot][:size]
        for t, spec, at in zip(tensors, specs, offsets, strict=True):
            flat[at : at + spec.nbytes] = _bytes_of(t, spec)
        pending[slot] = start(flat)
    for works in pending:
        finish(works)
    return failed


def _bytes_of(tensor: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    t = tensor.detach().to("cpu", DTYPES[spec.dtype]).contiguous()
    if tuple(t.shape) != spec.shape:
        raise ValueError(f"{spec.name}: shape {tuple(t.shape)}, the manifest says {spec.shape}")
    return t.reshape(-1).view(torch.uint8)


class Receiver:
    """An engine rank's side: joins the group as `rank`, reads the manifest; `tensors()` then yields each
    tensor as its bucket arrives (two buckets in memory at a time)."""

    def __init__(self, rendezvous: str, group: str, rank: int, size: int, timeout_s: float,
                 max_bytes: int, max_bucket_bytes: int = MAX_BUCKET_BYTES) -> None:  # fmt: skip
        host, port = split_address(rendezvous)
        if not GROUP_NAME.match(group) or not 0 < rank < size:
            raise ValueError(f"bad weight-sync group {group[:40]!r} or rank {rank} of {size}")
        try:
            store = TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
            store.set(f"{group}/ready/{rank}", "1")
            self._pg = _group(store, group, rank, size, timeout_s, route_address(host, port))
            length = torch.zeros(1, dtype=torch.int64)
            self._pg.broadcast(length, 0).wait()
            if not 0 < int(length) <= MAX_MANIFEST_BYTES:
                raise CheckpointError(f"weight sync: a manifest of {int(length)} bytes")
            header = torch.empty(int(length), dtype=torch.uint8)
            self._pg.broadcast(header, 0).wait()
        except RuntimeError as exc:  # the store or gloo: unreachable, timed out, a peer gone
            raise CheckpointError(f"weight sync with {rendezvous} failed: {exc}") from exc
        self.manifest = Manifest.from_bytes(header.numpy().tobytes(), max_bucket_bytes)
        if self.manifest.nbytes > max_bytes:
            raise CheckpointError(f"weight sync: {self.manifest.nbytes} bytes is over this worker's {max_bytes}")

    def tensors(self) -> Iterator[tuple[str, Received]]:
        """Each tensor as a view of its bucket's buffer. The next bucket's receive is posted before this one's
        tensors are handed out, so the network and the loader's copies overlap (two buckets in memory); a
        buffer is never reused, since the loader may keep views of it until a layer is whole."""
        buckets = self.manifest.buckets
        posted = self._post(buckets[0]) if buckets else None
        for k, bucket in enumerate(buckets):
            assert posted is not None
            flat, work = posted
            try:
                work.wait()
            except RuntimeError as exc:
                raise CheckpointError(f"weight sync: the sender stopped mid-way: {exc}") from exc
            posted = self._post(buckets[k + 1]) if k + 1 < len(buckets) else None
            for spec, at in zip(bucket, layout(bucket)[0], strict=True):
                part = flat[at : at + spec.nbytes].view(DTYPES[spec.dtype]).reshape(spec.shape)
                yield spec.name, Received(part)

    def _post(self, bucket: Sequence[TensorSpec]) -> tuple[torch.Tensor, Any]:
        flat = torch.empty(layout(bucket)[1], dtype=torch.uint8)
        try:
            return flat, self._pg.broadcast(flat, 0)
        except RuntimeError as exc:
            raise CheckpointError(f"weight sync: the sender stopped mid-way: {exc}") from exc

    def close(self) -> None:
        """Leaves the group (a sender still broadcasting to it fails at once instead of timing out)."""
        self._pg.abort()
