"""Weight sync over a collective: a version's tensors sent in buckets from the trainer's ranks to every rank of
an engine replica, without a file and without a whole copy anywhere.

One group per replica and sync, rendezvoused through a TCP store the trainer's rank 0 hosts: the trainer's S
ranks are ranks 0..S-1 (the senders), the replica's N ranks S..S+N-1. Sender 0 first sends each engine rank the
manifest (JSON: the tensors' on-disk names, shapes and dtypes, bucket by bucket, and which sender holds which
rows of each; never pickle, which would run a peer's code); then every sender sends each engine rank its
segment of every bucket (the rows it holds of the bucket's tensors, as one flat byte buffer), point to point,
so the bytes go from the shard that holds them straight to the engine: nothing is gathered on the trainer. Each
engine rank views its segments as tensors (the rows of a tensor split over senders joined) and hands them to
the loader, which copies the slices this rank's tensor/expert-parallel layout holds, so a rank holds its shard
plus two buckets (one arriving, one being read).

gloo carries the bytes (host tensors, over TCP). A sender that dies closes its sockets and every receiver's
wait fails at once; a silent one is bounded by the group's timeout.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from glm5.errors import CheckpointError

# safetensors' names of what may travel: the trainer's float weights, and a pushed checkpoint's stored formats
# (FP8 weights, INT4 words and scales, compressed-tensors' shapes) when a worker forwards one to its other hosts
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8}  # fmt: skip
NAMES = {v: k for k, v in DTYPES.items()}
MAX_BUCKET_BYTES = 4 << 30  # what one bucket may make a receiver allocate
MAX_MANIFEST_BYTES = 256 << 20
MAX_TENSORS = 4_000_000
MAX_SENDERS = 65_536
GROUP_NAME = re.compile(r"^[A-Za-z0-9._/-]{1,160}$")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,300}$")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, F16
    parts: tuple[tuple[int, int], ...] = ()  # (sender, rows of dim 0) in row order; () is all from sender 0
    # the part that travels, [start, stop) per dimension of `shape` (the one receiver needs only that); () is all
    box: tuple[tuple[int, int], ...] = ()

    @property
    def sent_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box) if self.box else self.shape

    @property
    def nbytes(self) -> int:
        """The bytes that travel."""
        return math.prod(self.sent_shape) * DTYPES[self.dtype].itemsize

    @property
    def pieces(self) -> tuple[tuple[int, int], ...]:
        """(sender, bytes) in row order."""
        shape = self.sent_shape
        rows = shape[0] if shape else 1
        per_row = self.nbytes // rows if rows else 0
        return tuple((s, n * per_row) for s, n in (self.parts or ((0, rows),)))


@dataclass(frozen=True, slots=True)
class Manifest:
    version: int
    buckets: tuple[tuple[TensorSpec, ...], ...]
    senders: int = 1
    # a forwarded checkpoint's every stored dtype, sent or not (they decide which layers are quantized), and its
    # config.json's quantization_config; empty for the trainer's float weights, which say it all themselves
    stored: dict[str, str] = field(default_factory=dict)
    quant: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for b in self.buckets for t in b)

    def dtypes(self) -> dict[str, str]:
        """Every tensor's stored dtype, as the loader wants it."""
        return self.stored or {t.name: t.dtype for b in self.buckets for t in b}

    def to_bytes(self) -> bytes:
        buckets = [[[t.name, list(t.shape), t.dtype, [list(p) for p in t.parts], [list(d) for d in t.box]]
                    for t in b] for b in self.buckets]  # fmt: skip
        raw: dict[str, Any] = {"version": self.version, "senders": self.senders, "buckets": buckets}
        if self.stored:
            raw["stored"] = self.stored
        if self.quant is not None:
            raw["quant"] = self.quant
        return json.dumps(raw, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, max_bucket_bytes: int = MAX_BUCKET_BYTES) -> Manifest:
        """A peer's manifest, checked: known dtypes, sane names and shapes, no name twice, each tensor's rows
        held by known senders and adding up, buckets bounded."""
        try:
            raw = json.loads(data)
            version, senders, buckets_raw = int(raw["version"]), int(raw.get("senders", 1)), raw["buckets"]
            buckets = tuple(
                tuple(TensorSpec(str(t[0]), tuple(int(d) for d in t[1]), str(t[2]), _parts(t), _box(t)) for t in b)
                for b in buckets_raw
            )
            stored = {str(k): str(v) for k, v in raw.get("stored", {}).items()}
            quant = raw.get("quant")
            if quant is not None and not isinstance(quant, dict):
                raise TypeError("quant must be an object")
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise CheckpointError(f"weight sync: the manifest is malformed: {exc}") from exc
        if not 0 < senders <= MAX_SENDERS:
            raise CheckpointError(f"weight sync: {senders} senders")
        seen: set[str] = set()
        for bucket in buckets:
            for t in bucket:
                if not _NAME.match(t.name) or t.name in seen:
                    raise CheckpointError(f"weight sync: bad or repeated tensor name {t.name[:80]!r}")
                if t.dtype not in DTYPES or len(t.shape) > 8 or any(d < 0 for d in t.shape):
                    raise CheckpointError(f"weight sync: tensor {t.name} has dtype {t.dtype} or shape {t.shape}")
                rows = t.shape[0] if t.shape else 1
                if t.parts and (sum(n for _, n in t.parts) != rows or len(t.parts) > senders
                                or any(not 0 <= s < senders or n <= 0 for s, n in t.parts)):  # fmt: skip
                    raise CheckpointError(f"weight sync: tensor {t.name}'s parts {t.parts[:4]} do not make {rows} rows")
                inside = len(t.box) == len(t.shape) and all(
                    0 <= a <= b <= d for (a, b), d in zip(t.box, t.shape, strict=True)
                )
                if t.box and (t.parts or not inside):
                    raise CheckpointError(f"weight sync: tensor {t.name}'s box {t.box[:8]} is not within {t.shape}")
                seen.add(t.name)
            size = sum(segments(bucket, senders)[1])
            if size > max_bucket_bytes:
                raise CheckpointError(f"weight sync: a bucket of {size} bytes is over the {max_bucket_bytes} limit")
        if len(seen) > MAX_TENSORS or len(stored) > MAX_TENSORS:
            raise CheckpointError(f"weight sync: {max(len(seen), len(stored))} tensors is over the {MAX_TENSORS} limit")
        bad = next((k for k, v in stored.items() if not _NAME.match(k) or v not in STORED_DTYPES), None)
        if bad is not None:
            raise CheckpointError(f"weight sync: bad stored tensor {bad[:80]!r} ({stored[bad][:16]})")
        if stored and not seen <= stored.keys():
            raise CheckpointError("weight sync: a tensor sent is missing from the stored dtypes")
        return cls(version, buckets, senders, stored, quant)


STORED_DTYPES = frozenset({*DTYPES, "F64", "BOOL"})  # what a checkpoint may hold (the loader refuses the rest)


def _parts(t: list[Any]) -> tuple[tuple[int, int], ...]:
    return tuple((int(s), int(n)) for s, n in t[3]) if len(t) > 3 else ()


def _box(t: list[Any]) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in t[4]) if len(t) > 4 else ()


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A loader's read index as [start, stop) per dimension; () when it reads the whole tensor."""
    box = []
    for d, size in enumerate(shape):
        start, stop, step = (index[d] if d < len(index) else slice(None)).indices(size)
        if step != 1:
            raise ValueError(f"a strided read {index[d]} cannot travel as a box")
        box.append((start, max(start, stop)))
    return () if all(a == 0 and b == size for (a, b), size in zip(box, shape, strict=True)) else tuple(box)


def _aligned(n: int) -> int:
    return -(-n // 8) * 8


def segments(bucket: Sequence[TensorSpec], senders: int) -> tuple[list[list[tuple[int, int, int]]], list[int]]:
    """Where each tensor's pieces lie in the senders' segments of a bucket: per tensor [(sender, offset, bytes)]
    in row order, and each sender's segment size. A sender's segment is its pieces in tensor order, each at an
    8-byte-aligned offset, so every piece is a view of the buffer whatever dtypes came before it."""
    used = [0] * senders
    places = []
    for spec in bucket:
        mine = []
        for sender, nbytes in spec.pieces:
            mine.append((sender, used[sender], nbytes))
            used[sender] += _aligned(nbytes)
        places.append(mine)
    return places, used


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
    """A tensor of a received bucket, read as the loader reads a file's (loader.TensorSource). With a box, only
    that part of the `shape` tensor came; reads must lie inside it."""

    def __init__(self, tensor: torch.Tensor, shape: tuple[int, ...] | None = None,
                 box: tuple[tuple[int, int], ...] = ()) -> None:  # fmt: skip
        self.tensor, self.box = tensor, box
        self._shape = tuple(tensor.shape) if shape is None else shape

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> str:
        return NAMES[self.tensor.dtype]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor:
        if not self.box:
            return self.tensor[index] if index else self.tensor
        local = []
        for (a, b), (start, stop) in zip(self.box, box_of(index, self._shape) or ((0, n) for n in self._shape),
                                         strict=True):  # fmt: skip
            if not a <= start <= stop <= b:
                raise CheckpointError(f"weight sync: a read of [{start}, {stop}) where only [{a}, {b}) was sent")
            local.append(slice(start - a, stop - a))
        return self.tensor[tuple(local)]


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


@dataclass(frozen=True, slots=True)
class Group:
    """One replica's group as a sender sees it: the engine ranks are `senders`..`size`-1."""

    pg: Any
    senders: int
    size: int


class Sender:
    """Trainer rank 0's side: hosts the rendezvous store on address:port (0: any free port), sees the engines
    arrive, and joins each group as sender 0."""

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

    def wait_engines(self, name: str, senders: int, size: int, abandoned: Callable[[], bool] = lambda: False) -> None:
        """Returns once every engine rank of group `name` is joining. Raises after the timeout, or as soon as
        `abandoned()` says they never will (the engine refused the sync)."""
        keys = [f"{name}/ready/{r}" for r in range(senders, size)]
        deadline = time.monotonic() + self.timeout_s
        while not self._store.check(keys):
            if abandoned():
                raise RuntimeError("the engine did not take the sync")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine's ranks did not join within {self.timeout_s:.0f}s")
            time.sleep(0.02)

    def group(self, name: str, senders: int, size: int) -> Group:
        return Group(_group(self._store, name, 0, size, self.timeout_s, self.address), senders, size)

    def close(self) -> None:
        self._listener.close()


def join_group(rendezvous: str, name: str, rank: int, senders: int, size: int, timeout_s: float) -> Group:
    """Trainer rank `rank` (> 0) joins group `name` through rank 0's store."""
    host, port = split_address(rendezvous)
    store = TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    return Group(_group(store, name, rank, size, timeout_s, route_address(host, port)), senders, size)


HEADER_TAGS = (0, 1)  # the manifest's length, then its bytes; bucket k travels under tag 2 + k


def send(groups: dict[str, Group], rank: int, manifest: Manifest,
         buckets: Iterator[Sequence[torch.Tensor]]) -> dict[str, str]:  # fmt: skip
    """Sender `rank`'s part of a sync: (rank 0: the manifest, then) its segment of every bucket, the tensors it
    holds of each in manifest order (`buckets` yields them), to every engine rank of every group. A group that
    fails is dropped and the rest go on; returns the failed groups' errors. `buckets` is consumed whole even
    when every group failed (it may drive collectives the other senders join).

    Two buffers, reused: bucket k goes out in the background (gloo's own threads) while bucket k+1 is packed,
    so packing and sending overlap; at most two segments in memory."""
    failed: dict[str, str] = {}

    def start(tensor: torch.Tensor, tag: int) -> dict[tuple[str, int], Any]:
        works = {}
        for key, g in groups.items():
            for dst in range(g.senders, g.size):
                if key not in failed:
                    try:
                        works[key, dst] = g.pg.send([tensor], dst, tag)
                    except RuntimeError as exc:
                        failed[key] = str(exc)
        return works

    def finish(works: dict[tuple[str, int], Any]) -> None:
        for (key, _), work in works.items():
            try:
                work.wait()
            except RuntimeError as exc:
                failed.setdefault(key, str(exc))

    if rank == 0:
        header = manifest.to_bytes()
        finish(start(torch.tensor([len(header)], dtype=torch.int64), HEADER_TAGS[0]))
        finish(start(torch.frombuffer(bytearray(header), dtype=torch.uint8), HEADER_TAGS[1]))
    plans = [segments(b, manifest.senders) for b in manifest.buckets]
    largest = max((sizes[rank] for _, sizes in plans), default=0)
    buffers: list[torch.Tensor] = []
    pending: list[dict[tuple[str, int], Any]] = [{}, {}]
    for k, (specs, tensors, (places, sizes)) in enumerate(zip(manifest.buckets, buckets, plans, strict=True)):
        mine = [(spec, at, n) for spec, where in zip(specs, places, strict=True) for s, at, n in where if s == rank]
        if len(tensors) != len(mine):
            raise ValueError(f"weight sync: sender {rank} has {len(tensors)} tensors for bucket {k}, not {len(mine)}")
        if not sizes[rank]:
            continue
        slot = k % 2
        finish(pending[slot])  # the buffer's previous segment has left
        if len(buffers) <= slot:
            buffers.append(torch.empty(largest, dtype=torch.uint8))
        flat = buffers[slot][: sizes[rank]]
        for t, (spec, at, n) in zip(tensors, mine, strict=True):
            flat[at : at + n] = _bytes_of(t, spec, n)
        pending[slot] = start(flat, 2 + k)
    for works in pending:
        finish(works)
    return failed


def _bytes_of(tensor: torch.Tensor, spec: TensorSpec, nbytes: int) -> torch.Tensor:
    t = tensor.detach().to("cpu", DTYPES[spec.dtype]).contiguous()
    if tuple(t.shape[1:]) != spec.sent_shape[1:] or t.numel() * t.element_size() != nbytes:
        raise ValueError(f"{spec.name}: a piece of shape {tuple(t.shape)} where the manifest has {nbytes} bytes of "
                         f"{spec.sent_shape}")  # fmt: skip
    return t.reshape(-1).view(torch.uint8)


class Receiver:
    """An engine rank's side: joins the group as `rank` (after the senders), reads the manifest from sender 0;
    `tensors()` then yields each tensor as its bucket arrives (two buckets in memory at a time)."""

    def __init__(self, rendezvous: str, group: str, rank: int, size: int, timeout_s: float,
                 max_bytes: int, max_bucket_bytes: int = MAX_BUCKET_BYTES, senders: int = 1) -> None:  # fmt: skip
        host, port = split_address(rendezvous)
        if not GROUP_NAME.match(group) or not 0 < senders <= rank < size:
            raise ValueError(f"bad weight-sync group {group[:40]!r} or rank {rank} of {size} after {senders} senders")
        self.senders = senders
        try:
            store = TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
            store.set(f"{group}/ready/{rank}", "1")
            self._pg = _group(store, group, rank, size, timeout_s, route_address(host, port))
            length = torch.zeros(1, dtype=torch.int64)
            self._pg.recv([length], 0, HEADER_TAGS[0]).wait()
            if not 0 < int(length) <= MAX_MANIFEST_BYTES:
                raise CheckpointError(f"weight sync: a manifest of {int(length)} bytes")
            header = torch.empty(int(length), dtype=torch.uint8)
            self._pg.recv([header], 0, HEADER_TAGS[1]).wait()
        except RuntimeError as exc:  # the store or gloo: unreachable, timed out, a peer gone
            raise CheckpointError(f"weight sync with {rendezvous} failed: {exc}") from exc
        self.manifest = Manifest.from_bytes(header.numpy().tobytes(), max_bucket_bytes)
        if self.manifest.senders != senders:
            raise CheckpointError(f"weight sync: the manifest names {self.manifest.senders} senders, not {senders}")
        if self.manifest.nbytes > max_bytes:
            raise CheckpointError(f"weight sync: {self.manifest.nbytes} bytes is over this worker's {max_bytes}")

    def tensors(self) -> Iterator[tuple[str, Received]]:
        """Each tensor as a view of its bucket's buffers (the rows of a tensor split over senders joined). The
        next bucket's receives are posted before this one's tensors are handed out, so the network and the
        loader's copies overlap; a buffer is never reused, since the loader may keep views of it until a layer
        is whole."""
        buckets = self.manifest.buckets
        posted = self._post(0) if buckets else None
        for k, bucket in enumerate(buckets):
            assert posted is not None
            flats, works = posted
            try:
                for work in works:
                    work.wait()
            except RuntimeError as exc:
                raise CheckpointError(f"weight sync: a sender stopped mid-way: {exc}") from exc
            posted = self._post(k + 1) if k + 1 < len(buckets) else None
            for spec, where in zip(bucket, segments(bucket, self.senders)[0], strict=True):
                views = [flats[s][at : at + n].view(DTYPES[spec.dtype]) for s, at, n in where]
                whole = views[0] if len(views) == 1 else torch.cat(views)
                yield spec.name, Received(whole.reshape(spec.sent_shape), spec.shape, spec.box)

    def _post(self, k: int) -> tuple[list[torch.Tensor], list[Any]]:
        sizes = segments(self.manifest.buckets[k], self.senders)[1]
        flats = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        try:
            return flats, [self._pg.recv([flat], s, 2 + k) for s, flat in enumerate(flats) if flat.numel()]
        except RuntimeError as exc:
            raise CheckpointError(f"weight sync: a sender stopped mid-way: {exc}") from exc

    def close(self) -> None:
        """Leaves the group (a sender still sending to it fails at once instead of timing out)."""
        self._pg.abort()
