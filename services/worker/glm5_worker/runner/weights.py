"""In-place weight updates (RL weight sync): read the new weights while serving (a checkpoint folder, or the
tensors a trainer broadcasts over a sync group), then copy them into the live model between two engine steps."""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from glm5.errors import CheckpointError, InvalidRequestError
from glm5.model.config import ModelConfig
from glm5.model.loader import (
    Lazy,
    build_model,
    checkpoint_files,
    iter_tensors,
    load_model,
    shard_reads,
    stored_dtypes,
)
from glm5.model.model import GlmMoeDsaForCausalLM
from glm5.model.quant import QuantConfig
from glm5.parallel import SINGLE, TensorParallel
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.weight_sync import DTYPES, Manifest, Receiver, Sender, TensorSpec, box_of, plan_buckets, send

log = logging.getLogger(__name__)
# Geometry that must match for an in-place swap (everything that shapes a tensor or the KV layout).
GEOMETRY = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
            "moe_intermediate_size", "intermediate_size", "first_k_dense_replace", "index_n_heads", "index_head_dim",
            "index_topk")  # fmt: skip


@dataclass(frozen=True, slots=True)
class SyncSpec:
    """A SyncWeights update's source: the trainer's group, which this rank joins as senders + its replica rank."""

    version: int
    rendezvous: str
    group: str
    world_size: int
    timeout_s: float
    max_bytes: int  # what the manifest may declare (the trainer's float32 of our bf16 is twice our bytes)
    tokenizer_fingerprint: str = ""
    senders: int = 1  # the trainer's ranks in the group, each sending the rows it holds
    member: int | None = None  # this rank's place in the group (None: senders + its replica rank)


FORWARD_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Forwarded:
    """A pushed checkpoint staged on rank 0's host only (a multi-pod replica under the stream transport): the
    ranks on that host read the folder; every other host's rank receives exactly the parts of each tensor its
    shard needs from rank 0, over a group of two (rank 0 sending) through rank 0's store."""

    path: str
    version: int
    rendezvous: str
    group: str  # rank r joins `group/r`
    ranks_per_node: int
    timeout_s: float
    max_bytes: int

    def for_rank(self, rank: int) -> str | SyncSpec:
        if rank < self.ranks_per_node:
            return self.path
        return SyncSpec(self.version, self.rendezvous, f"{self.group}/{rank}", 2, self.timeout_s, self.max_bytes,
                        member=1)  # fmt: skip


WeightSource = str | SyncSpec | Forwarded  # a checkpoint folder, a sync group, or a folder on rank 0's host


def read_weights(source: WeightSource, current: ModelConfig, dtype: torch.dtype, device: torch.device,
                 fingerprint: str, tp: TensorParallel = SINGLE, mtp: str = "skip") -> GlmMoeDsaForCausalLM:  # fmt: skip
    """This rank's shard of the new weights, from wherever they come (blocking: off the engine thread). `mtp`:
    "stored" on a worker that drafts with its MTP layers (an update that carries them replaces them; one that
    does not, a trainer's policy, leaves the served ones: swap_in_place)."""
    if isinstance(source, Forwarded):
        source = source.for_rank(tp.rank)
    if isinstance(source, SyncSpec):
        return receive_checkpoint(source, current, dtype, device, fingerprint, tp, mtp)
    return read_checkpoint(source, current, dtype, device, fingerprint, tp, mtp)


def receive_checkpoint(spec: SyncSpec, current: ModelConfig, dtype: torch.dtype, device: torch.device,
                       fingerprint: str, tp: TensorParallel = SINGLE,
                       mtp: str = "skip") -> GlmMoeDsaForCausalLM:  # fmt: skip
    """Joins the trainer's group and builds this rank's shard from the buckets as they arrive (two buckets in
    memory at a time); the served geometry, so a tensor of another shape fails the update."""
    if spec.tokenizer_fingerprint and spec.tokenizer_fingerprint != fingerprint:
        raise CheckpointError("the trainer's policy has another tokenizer than the served model (fingerprint differs)")
    member = spec.senders + tp.rank if spec.member is None else spec.member
    receiver = Receiver(spec.rendezvous, spec.group, member, spec.world_size, spec.timeout_s, spec.max_bytes,
                        senders=spec.senders)  # fmt: skip
    try:
        manifest = receiver.manifest
        if manifest.version != spec.version:
            raise CheckpointError(f"the sender sends version {manifest.version}, not {spec.version}")
        quant = QuantConfig.from_config(manifest.quant)
        specs = [t for bucket in manifest.buckets for t in bucket]
        # what this rank's shard reads of each tensor (the loader's own rules on the meta device): only that comes
        reads = shard_reads(current, ((t.name, t) for t in specs), manifest.dtypes(), dtype, quant=quant, tp=tp)
        coming = receiver.request([box_of(reads[t.name], t.shape) if t.name in reads else None for t in specs])
        log.info("weight sync %s: rank %d receives %d of the version's %d bytes", spec.group, tp.rank, coming,
                 manifest.nbytes)  # fmt: skip
        return build_model(current, receiver.tensors(), manifest.dtypes(), dtype, device, tp=tp, quant=quant,
                           total_bytes=coming, source=f"weight sync {spec.group}", mtp=mtp)  # fmt: skip
    except BaseException:
        receiver.close()  # the trainer's broadcast to this group fails now rather than at its timeout
        raise


Buckets = Iterator[list[Lazy]]


def forward_plan(path: Path, version: int, bucket_bytes: int = FORWARD_BUCKET_BYTES) -> tuple[Manifest, Buckets]:
    """The checkpoint at `path` as a sync from one sender: a manifest of its tensors as stored (with every stored
    dtype and its quantization_config, which decide the layers' formats), and each bucket's tensors as file
    sources the sender reads only the requested parts of."""
    files = checkpoint_files(path)
    stored = stored_dtypes(files)
    raw = json.loads((path / "config.json").read_text()).get("quantization_config")
    # a format no loader path reads (F64, BOOL) cannot travel; a rank that needed one would report it missing
    specs = [TensorSpec(name, lazy.shape, lazy.dtype) for name, lazy in iter_tensors(files) if lazy.dtype in DTYPES]
    manifest = Manifest(version, plan_buckets(specs, bucket_bytes), stored=stored, quant=raw)

    def buckets() -> Buckets:
        sizes = iter([len(b) for b in manifest.buckets])
        want, bucket = next(sizes, 0), []
        for _, lazy in iter_tensors(files):  # the file stays open while its tensors' parts are read
            if lazy.dtype not in DTYPES:
                continue
            bucket.append(lazy)
            if len(bucket) == want:
                yield bucket
                want, bucket = next(sizes, 0), []

    return manifest, buckets()


class Forwarder:
    """Rank 0's side of a Forwarded update: hosts the store on `address` and sends each other host's rank the
    parts it asks for (the manifest is the whole checkpoint; each rank requests what its shard reads), one thread
    per rank; `close()` ends what is still waiting (an update that failed elsewhere)."""

    def __init__(self, path: str, version: int, tp: TensorParallel, ranks_per_node: int, address: str,
                 timeout_s: float, max_bytes: int) -> None:  # fmt: skip
        self._sender = Sender(address, 0, timeout_s)
        group = f"glm5-forward-{secrets.token_hex(16)}"
        self.source = Forwarded(path, version, self._sender.rendezvous, group, ranks_per_node, timeout_s, max_bytes)
        self._stop = threading.Event()
        self.errors: dict[int, str] = {}
        self._threads = [threading.Thread(target=self._send, args=(r, Path(path), version), name=f"glm5-forward-{r}",
                                          daemon=True) for r in range(ranks_per_node, tp.size)]  # fmt: skip
        for t in self._threads:
            t.start()

    def _send(self, rank: int, path: Path, version: int) -> None:
        name = f"{self.source.group}/{rank}"
        try:
            manifest, buckets = forward_plan(path, version)
            self._sender.wait_engines(name, 1, 2, abandoned=self._stop.is_set)
            group = self._sender.group(name, 1, 2)
            try:
                failed = send({name: group}, 0, manifest, buckets)
            finally:
                group.pg.abort()
            if failed:
                self.errors[rank] = failed[name]
        except Exception as exc:  # the rank's read fails on its side too: the update is refused there
            self.errors[rank] = str(exc)
        if rank in self.errors:
            log.warning("forwarding weights v%d to rank %d failed: %s", version, rank, self.errors[rank])

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.source.timeout_s)
        self._sender.close()


def read_checkpoint(
    location: str,
    current: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    fingerprint: str,
    tp: TensorParallel = SINGLE,
    mtp: str = "skip",
) -> GlmMoeDsaForCausalLM:
    """The new weights (this rank's shard) as a model on the serving device (blocking: run it off the engine
    thread). A checkpoint that ships a tokenizer must ship the served one: token ids would silently change
    meaning otherwise."""
    path = Path(location)
    if not location or not path.is_dir():
        raise InvalidRequestError("location", f"{location!r} is not a checkpoint directory this worker can read")
    new_config = ModelConfig.from_file(path)
    diff = [f"{k}: {getattr(current, k)} -> {getattr(new_config, k)}" for k in GEOMETRY
            if getattr(current, k, None) != getattr(new_config, k, None)]  # fmt: skip
    if diff:
        raise CheckpointError(f"{location} has another geometry than the served model ({'; '.join(diff)})")
    if (path / "tokenizer.json").is_file() and Tokenizer(path).fingerprint != fingerprint:
        raise CheckpointError(f"{location} has another tokenizer than the served model (fingerprint differs)")
    return load_model(path, dtype, device, rope=current.rope, tp=tp, mtp=mtp)


@torch.no_grad()
def swap_in_place(live: GlmMoeDsaForCausalLM, new: GlmMoeDsaForCausalLM) -> int:
    """Copies every parameter and buffer of `new` into `live` (same names, shapes, dtypes); returns bytes. The
    live model's MTP layers stay as they are when `new` has none (a policy trains the model, not its drafter: a
    stale drafter only lowers acceptance, never changes what is accepted)."""
    target = {**dict(live.named_parameters()), **dict(live.named_buffers())}
    source = {**dict(new.named_parameters()), **dict(new.named_buffers())}
    if live.mtp_layers and not new.mtp_layers:
        first = live.config.num_hidden_layers
        target = {k: v for k, v in target.items() if not _in_layers_from(k, first)}
    if set(target) != set(source):
        raise CheckpointError(f"tensor names differ: {sorted(set(target) ^ set(source))[:4]}")
    moved = 0
    for name, tensor in target.items():
        tensor.copy_(source[name])
        moved += tensor.numel() * tensor.element_size()
    return moved


def _in_layers_from(name: str, first: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= first
