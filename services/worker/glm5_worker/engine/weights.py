"""In-place weight updates (RL weight sync): read the new weights while serving (a checkpoint folder, or the
tensors a trainer broadcasts over a sync group), then copy them into the live model between two engine steps."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from glm5.errors import CheckpointError, InvalidRequestError
from glm5.model.config import ModelConfig
from glm5.model.loader import build_model, load_model
from glm5.model.model import GlmMoeDsaForCausalLM
from glm5.parallel import SINGLE, TensorParallel
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.weight_sync import Receiver

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


WeightSource = str | SyncSpec  # a checkpoint folder, or a sync group


def read_weights(source: WeightSource, current: ModelConfig, dtype: torch.dtype, device: torch.device,
                 fingerprint: str, tp: TensorParallel = SINGLE) -> GlmMoeDsaForCausalLM:  # fmt: skip
    """This rank's shard of the new weights, from wherever they come (blocking: off the engine thread)."""
    if isinstance(source, SyncSpec):
        return receive_checkpoint(source, current, dtype, device, fingerprint, tp)
    return read_checkpoint(source, current, dtype, device, fingerprint, tp)


def receive_checkpoint(spec: SyncSpec, current: ModelConfig, dtype: torch.dtype, device: torch.device,
                       fingerprint: str, tp: TensorParallel = SINGLE) -> GlmMoeDsaForCausalLM:  # fmt: skip
    """Joins the trainer's group and builds this rank's shard from the buckets as they arrive (two buckets in
    memory at a time); the served geometry, so a tensor of another shape fails the update."""
    if spec.tokenizer_fingerprint and spec.tokenizer_fingerprint != fingerprint:
        raise CheckpointError("the trainer's policy has another tokenizer than the served model (fingerprint differs)")
    receiver = Receiver(spec.rendezvous, spec.group, spec.senders + tp.rank, spec.world_size, spec.timeout_s,
                        spec.max_bytes, senders=spec.senders)  # fmt: skip
    try:
        if receiver.manifest.version != spec.version:
            raise CheckpointError(f"the trainer sends version {receiver.manifest.version}, not {spec.version}")
        return build_model(current, receiver.tensors(), receiver.manifest.dtypes(), dtype, device, tp=tp,
                           total_bytes=receiver.manifest.nbytes, source=f"weight sync {spec.group}")  # fmt: skip
    except BaseException:
        receiver.close()  # the trainer's broadcast to this group fails now rather than at its timeout
        raise


def read_checkpoint(
    location: str,
    current: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    fingerprint: str,
    tp: TensorParallel = SINGLE,
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
    return load_model(path, dtype, device, rope=current.rope, tp=tp)


@torch.no_grad()
def swap_in_place(live: GlmMoeDsaForCausalLM, new: GlmMoeDsaForCausalLM) -> int:
    """Copies every parameter and buffer of `new` into `live` (same names, shapes, dtypes); returns bytes."""
    target = {**dict(live.named_parameters()), **dict(live.named_buffers())}
    source = {**dict(new.named_parameters()), **dict(new.named_buffers())}
    if set(target) != set(source):
        raise CheckpointError(f"tensor names differ: {sorted(set(target) ^ set(source))[:4]}")
    moved = 0
    for name, tensor in target.items():
        tensor.copy_(source[name])
        moved += tensor.numel() * tensor.element_size()
    return moved
