"""Weight sync over a collective: a version's tensors sent in buckets from the trainer's ranks to every rank of
an engine replica, without a file and without a whole copy anywhere.

One group per replica and sync, rendezvoused through a TCP store the trainer's rank 0 hosts: the trainer's S
ranks are ranks 0..S-1 (the senders), the replica's N ranks S..S+N-1. Sender 0 first sends each engine rank the
manifest (JSON: the tensors' on-disk names, shapes and dtypes, bucket by bucket, and which sender holds which
rows of each; never pickle, which would run a peer's code). Each engine rank answers every sender with its
request: what its shard reads of each tensor (a box of [start, stop) per dimension, all of it, or nothing),
which it finds by running the loader on the manifest's tensors without data. Then every sender sends each
engine rank its segment of every bucket (the rows it holds of what that rank asked for, as one flat byte
buffer), point to point, so the bytes go from the shard that holds them straight to the engine rank that
needs them: nothing is gathered on the trainer and no rank receives another's part. Each engine rank views its
segments as tensors (the rows of a tensor split over senders joined) and hands them to the loader, so a rank
holds its shard plus two buckets' parts (one arriving, one being read).

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
from glm5.model.loader import STORED_DTYPES as STORED

# safetensors' names of what may travel: the trainer's float weights, and a pushed checkpoint's stored formats
# (FP8 weights, INT4 words and scales, compressed-tensors' shapes) when a worker forwards one to its other hosts
DTYPES = {name: dtype for name, dtype in STORED.items() if name not in ("F64", "BOOL")}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_BUCKET_BYTES = 4 << 30  # what one bucket may make a receiver allocate
MAX_MANIFEST_BYTES = 256 << 20
MAX_TENSORS = 4_000_000
MAX_SENDERS = 65_536
GROUP_NAME = re.compile(r"^[A-Za-z0-9._/-]{1,160}$")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,300}$")


Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension; () is the whole tensor
Need = Box | None  # what one engine rank reads of a tensor (None: nothing, its shard has no part of it)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a sync under its on-disk name; also a loader TensorSource without data (`read` gives meta
    tensors), which is how an engine rank finds, before any byte arrives, what it needs of each."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, F16, F8_E4M3, I32, ...
    parts: tuple[tuple[int, int], ...] = ()  # (sender, rows of dim 0) in row order; () is all from sender 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @property
    def rows(self) -> tuple[tuple[int, int, int], ...]:
        """(sender, first row, end row) in row order (a 0-dim tensor is one row)."""
        out, at = [], 0
        for sender, n in self.parts or ((0, self.shape[0] if self.shape else 1),):
            out.append((sender, at, at + n))
            at += n
        return tuple(out)

    def cut(self, need: Need) -> list[tuple[int, int, int, int]]:
        """The pieces that carry `need`: (sender, first row, end row, bytes) of the rows each sender holds
        inside it, in row order."""
        if need is None:
            return []
        shape = self.shape or (1,)
        first, end = need[0] if need else (0, shape[0])
        inner = math.prod(b - a for a, b in need[1:]) if need else math.prod(shape[1:])
        size = DTYPES[self.dtype].itemsize
        out = []
        for sender, a, b in self.rows:
            lo, hi = max(a, first), min(b, end)
            if lo < hi:
                out.append((sender, lo, hi, (hi - lo) * inner * size))
        return out

    @property
    def pieces(self) -> tuple[tuple[int, int], ...]:
        """(sender, bytes) of the whole tensor, in row order."""
        return tuple((sender, n) for sender, _, _, n in self.cut(()))

    def read(self, index: tuple[slice, ...] = ()) -> torch.Tensor:
        part = torch.empty(self.shape, dtype=DTYPES[self.dtype], device="meta")
        return part[index] if index else part


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
        buckets = [[[t.name, list(t.shape), t.dtype, [list(p) for p in t.parts]] for t in b] for b in self.buckets]
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
                tuple(TensorSpec(str(t[0]), tuple(int(d) for d in t[1]), str(t[2]), _parts(t)) for t in b)
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


STORED_DTYPES = frozenset(STORED)  # what a checkpoint may hold (the loader refuses the rest)


def _parts(t: list[Any]) -> tuple[tuple[int, int], ...]:
    return tuple((int(s), int(n)) for s, n in t[3]) if len(t) > 3 else ()


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
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


def segments(bucket: Sequence[TensorSpec], senders: int,
             needs: Sequence[Need] | None = None) -> tuple[list[list[tuple[int, int, int]]], list[int]]:  # fmt: skip
    """Where each tensor's pieces lie in the senders' segments of a bucket for one engine rank (`needs`: what it
    reads of each tensor; None: everything): per tensor [(sender, offset, bytes)] in row order, and each sender's
    segment size. A sender's segment is its pieces in tensor order, each at an 8-byte-aligned offset, so every
    piece is a view of the buffer whatever dtypes came before it."""
    used = [0] * senders
    places = []
    for i, spec in enumerate(bucket):
        mine = []
        for sender, _, _, nbytes in spec.cut(needs[i] if needs is not None else ()):
            mine.append((sender, used[sender], nbytes))
            used[sender] += _aligned(nbytes)
        places.append(mine)
    return places, used


def sent_shape(spec: TensorSpec, need: Need) -> tuple[int, ...]:
    return tuple(b - a for a, b in need) if need else spec.shape


def encode_needs(needs: Sequence[Need]) -> bytes:
    return json.dumps([None if n is None else [list(d) for d in n] for n in needs], separators=(",", ":")).encode()


def decode_needs(data: bytes, manifest: Manifest) -> list[list[Need]]:
    """An engine rank's request, checked against the manifest: per bucket, per tensor, a box inside the tensor,
    [] for all of it or null for none."""
    specs = [t for b in manifest.buckets for t in b]
    try:
        raw = json.loads(data)
        if not isinstance(raw, list) or len(raw) != len(specs):
            raise ValueError(f"{len(raw) if isinstance(raw, list) else 'no'} entries for {len(specs)} tensors")
        flat: list[Need] = [None if n is None else tuple((int(a), int(b)) for a, b in n) for n in raw]
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"weight sync: an engine's request is malformed: {exc}") from exc
    for spec, need in zip(specs, flat, strict=True):
        if need and (len(need) != len(spec.shape)
                     or any(not 0 <= a <= b <= d for (a, b), d in zip(need, spec.shape, strict=True))):  # fmt: skip
            raise CheckpointError(f"weight sync: a request for {need[:8]} of {spec.name} {spec.shape}")
    out, at = [], 0
    for bucket in manifest.buckets:
        out.append(flat[at : at + len(bucket)])
        at += len(bucket)
    return out


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


HEADER_TAGS = (0, 1)  # sender 0 to each engine rank: the manifest's length, then its bytes
REQUEST_TAGS = (2, 3)  # each engine rank to each sender: what it reads of each tensor (length, bytes)
BUCKET_TAG = 4  # bucket k travels under tag BUCKET_TAG + k


def send(groups: dict[str, Group], rank: int, manifest: Manifest,
         buckets: Iterator[Sequence[Any]]) -> dict[str, str]:  # fmt: skip
    """Sender `rank`'s part of a sync: (rank 0: the manifest, then) every engine rank's request, then for every
    bucket and engine rank the rows this sender holds of what that rank reads of each tensor (its columns too,
    where it reads only some), to every engine rank of every group. `buckets` yields this sender's tensors of
    each bucket in manifest order (tensors of its rows, or loader TensorSources read by index). A group that
    fails is dropped and the rest go on; returns the failed groups' errors. `buckets` is consumed whole even
    when every group failed (it may drive collectives the other senders join).

    Two buffers, reused: one segment goes out in the background (gloo's own threads) while the next is packed,
    so packing and sending overlap; at most two segments in memory."""
    failed: dict[str, str] = {}
    dsts = [(key, dst) for key, g in groups.items() for dst in range(g.senders, g.size)]

    def start(key: str, dst: int, tensor: torch.Tensor, tag: int, op: str = "send") -> Any:
        if key in failed:
            return None
        try:
            pg = groups[key].pg
            return pg.send([tensor], dst, tag) if op == "send" else pg.recv([tensor], dst, tag)
        except RuntimeError as exc:
            failed[key] = str(exc)
            return None

    def finish(works: dict[tuple[str, int], Any]) -> None:
        for (key, _), work in works.items():
            if work is None:
                continue
            try:
                work.wait()
            except RuntimeError as exc:
                failed.setdefault(key, str(exc))

    if rank == 0:
        header = manifest.to_bytes()
        length = torch.tensor([len(header)], dtype=torch.int64)
        finish({d: start(*d, length, HEADER_TAGS[0]) for d in dsts})
        body = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        finish({d: start(*d, body, HEADER_TAGS[1]) for d in dsts})
    needs = _requests(dsts, manifest, start, finish, failed)
    buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
    pending: list[dict[tuple[str, int], Any]] = [{}, {}]
    slot = 0
    for k, (specs, tensors) in enumerate(zip(manifest.buckets, buckets, strict=True)):
        held = [i for i, spec in enumerate(specs) if any(s == rank for s, _, _ in spec.rows)]
        if len(tensors) != len(held):
            raise ValueError(f"weight sync: sender {rank} has {len(tensors)} tensors for bucket {k}, not {len(held)}")
        source = dict(zip(held, tensors, strict=True))
        first_row = {i: next(a for s, a, _ in specs[i].rows if s == rank) for i in held}
        for key, dst in dsts:
            if key in failed:
                continue
            need = needs[key, dst][k]
            places, sizes = segments(specs, manifest.senders, need)
            if not sizes[rank]:
                continue
            slot ^= 1
            finish(pending[slot])  # the buffer's previous segment has left
            if buffers[slot].numel() < sizes[rank]:
                buffers[slot] = torch.empty(sizes[rank], dtype=torch.uint8)
            flat = buffers[slot][: sizes[rank]]
            for i, where in enumerate(places):
                cut = [c for c in specs[i].cut(need[i]) if c[0] == rank]
                for (_, at, n), (_, lo, hi, _) in zip([w for w in where if w[0] == rank], cut, strict=True):
                    columns = (slice(a, b) for a, b in (need[i] or ())[1:])
                    index = (slice(lo - first_row[i], hi - first_row[i]), *columns) if specs[i].shape else ()
                    flat[at : at + n] = _bytes_of(_read(source[i], index), specs[i], n)
            pending[slot] = {(key, dst): start(key, dst, flat, BUCKET_TAG + k)}
    for works in pending:
        finish(works)
    return failed


def _requests(dsts: list[tuple[str, int]], manifest: Manifest, start: Callable[..., Any],
              finish: Callable[[dict[tuple[str, int], Any]], None], failed: dict[str, str]
              ) -> dict[tuple[str, int], list[list[Need]]]:  # fmt: skip
    """Every engine rank's request (what it reads of each tensor), checked; a group with a bad one fails."""
    lengths = {d: torch.zeros(1, dtype=torch.int64) for d in dsts}
    finish({d: start(*d, lengths[d], REQUEST_TAGS[0], "recv") for d in dsts})
    bodies: dict[tuple[str, int], torch.Tensor] = {}
    for d in dsts:
        n = int(lengths[d])
        if d[0] not in failed and not 0 < n <= MAX_MANIFEST_BYTES:
            failed[d[0]] = f"an engine rank's request of {n} bytes"
        bodies[d] = torch.empty(max(n, 0) if d[0] not in failed else 0, dtype=torch.uint8)
    finish({d: start(*d, bodies[d], REQUEST_TAGS[1], "recv") for d in dsts})
    out: dict[tuple[str, int], list[list[Need]]] = {}
    for d in dsts:
        if d[0] in failed:
            continue
        try:
            out[d] = decode_needs(bodies[d].numpy().tobytes(), manifest)
        except CheckpointError as exc:
            failed[d[0]] = str(exc)
    return out


def _read(source: Any, index: tuple[slice, ...]) -> torch.Tensor:
    if isinstance(source, torch.Tensor):
        return source[index]
    part: torch.Tensor = source.read(index)  # a checkpoint file's tensor (loader.TensorSource)
    return part


def _bytes_of(tensor: torch.Tensor, spec: TensorSpec, nbytes: int) -> torch.Tensor:
    t = tensor.detach().to("cpu", DTYPES[spec.dtype]).contiguous()
    if t.numel() * t.element_size() != nbytes:
        raise ValueError(f"{spec.name}: a piece of shape {tuple(t.shape)} where the manifest has {nbytes} bytes")
    return t.reshape(-1).view(torch.uint8)


class Receiver:
    """An engine rank's side: joins the group as `rank` (after the senders) and reads the manifest from sender 0;
    `request(needs)` tells every sender what it reads of each tensor; `tensors()` then yields those parts as
    their buckets arrive (two buckets in memory at a time)."""

    def __init__(self, rendezvous: str, group: str, rank: int, size: int, timeout_s: float,
                 max_bytes: int, max_bucket_bytes: int = MAX_BUCKET_BYTES, senders: int = 1) -> None:  # fmt: skip
        host, port = split_address(rendezvous)
        if not GROUP_NAME.match(group) or not 0 < senders <= rank < size:
            raise ValueError(f"bad weight-sync group {group[:40]!r} or rank {rank} of {size} after {senders} senders")
        self.senders = senders
        self._needs: list[list[Need]] | None = None
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

    def request(self, needs: Sequence[Need]) -> int:
        """Sends every sender what this rank reads of each tensor (in manifest order: a box, () for all of it,
        None for none); returns the bytes that will come."""
        body = encode_needs(needs)
        self._needs = decode_needs(body, self.manifest)
        data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        try:
            for tensor, tag in (
                (torch.tensor([len(body)], dtype=torch.int64), REQUEST_TAGS[0]),
                (data, REQUEST_TAGS[1]),
            ):
                for work in [self._pg.send([tensor], s, tag) for s in range(self.senders)]:
                    work.wait()
        except RuntimeError as exc:
            raise CheckpointError(f"weight sync: a sender stopped before the request: {exc}") from exc
        return sum(
            sum(segments(b, self.senders, n)[1]) for b, n in zip(self.manifest.buckets, self._needs, strict=True)
        )

    def tensors(self) -> Iterator[tuple[str, Received]]:
        """The part of each requested tensor, as a view of its bucket's buffers (the rows a tensor's senders hold
        joined). The next bucket's receives are posted before this one's tensors are handed out, so the network
        and the loader's copies overlap; a buffer is never reused, since the loader may keep views of it until a
        layer is whole."""
        if self._needs is None:
            raise RuntimeError("request() first: the senders wait for it")
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
            needs = self._needs[k]
            for spec, need, where in zip(bucket, needs, segments(bucket, self.senders, needs)[0], strict=True):
                if need is None:
                    continue
                views = [flats[s][at : at + n].view(DTYPES[spec.dtype]) for s, at, n in where]
                whole = views[0] if len(views) == 1 else torch.cat(views)
                yield spec.name, Received(whole.reshape(sent_shape(spec, need)), spec.shape, need)

    def _post(self, k: int) -> tuple[list[torch.Tensor], list[Any]]:
        assert self._needs is not None
        sizes = segments(self.manifest.buckets[k], self.senders, self._needs[k])[1]
        flats = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        try:
            return flats, [self._pg.recv([flat], s, BUCKET_TAG + k) for s, flat in enumerate(flats) if flat.numel()]
        except RuntimeError as exc:
            raise CheckpointError(f"weight sync: a sender stopped mid-way: {exc}") from exc

    def close(self) -> None:
        """Leaves the group (a sender still sending to it fails at once instead of timing out)."""
        self._pg.abort()
