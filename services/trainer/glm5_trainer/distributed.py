"""The trainer as a torch.distributed program (issue 35): the world it runs in, the policy sharded with FSDP2, a
batch split over the ranks by tokens, and the collectives that make a sharded step equal to one process's.

The world comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: torchrun,
a Kubeflow PyTorchJob or an Indexed Job set them). The backend follows the device: gloo on CPU, nccl on CUDA,
hccl on Ascend (torch_npu is imported only then).

Data parallelism over the FSDP group: every rank holds the whole batch's records (rank 0 receives them and
broadcasts them), computes the group advantages and the token counts over all of them, and trains on its own
rows (`split_by_tokens`: similar token counts per rank). Each rank's loss is its rows' share of the whole batch's
loss (normalised by the global token count), so the sum over ranks is the single-process loss and the gradients
FSDP reduces (summed: the divide factor is 1) are the single-process gradients.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from glm5.errors import ConfigError
from glm5.model.loader import checkpoint_files, on_disk
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from glm5_trainer.sync import held, layout

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or not 0 <= self.local_rank <= self.rank:
            raise ConfigError(f"rank {self.rank}, local rank {self.local_rank} in a world of {self.size}")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"master port {self.master_port} is not a port")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> World:
        """torchrun's variables; a process without them is a world of one."""
        env = dict(os.environ if env is None else env)
        if "WORLD_SIZE" not in env:
            return cls()
        try:
            return cls(int(env.get("RANK", "0")), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                       env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")))  # fmt: skip
        except ValueError as exc:
            raise ConfigError(f"torchrun's environment ({', '.join(ENV)}) must hold integers: {exc}") from exc

    @property
    def leader(self) -> bool:
        """Rank 0: the one that talks to the gateway, the buffer, the engines and the status port."""
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    if device.type not in BACKENDS:
        raise ConfigError(f"no collective backend for device {device.type!r} (have: {', '.join(BACKENDS)})")
    if device.type == "npu":
        import torch_npu  # noqa: F401  # registers the npu device and hccl; only importable where CANN is
    return BACKENDS[device.type]


def init(world: World, device: torch.device, timeout_s: float = 300.0) -> None:
    """Joins the process group (a world of one joins too: FSDP2 needs a mesh). `timeout_s` bounds every
    collective, so a dead rank makes the others fail instead of hang."""
    if dist.is_initialized():
        return
    dist.init_process_group(backend_for(device), init_method=f"tcp://{world.master_addr}:{world.master_port}",
                            rank=world.rank, world_size=world.size,
                            timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip


def leave(code: int = 0) -> NoReturn:
    """Ends a rank's normal run: leaves the process group, if joined, flushes logs and standard streams and exits
    with `code` without the interpreter's finalization. Finalization is where gloo kills ranks that finished their
    work: a gloo run-loop thread drops its last reference to a finished collective's tensors after its caller
    moved on, that decref needs the GIL, and a finalizing interpreter answers by ending the thread, whose unwind
    through a noexcept destructor calls std::terminate ("terminate called without an active exception",
    SIGABRT; seen in gdb, about 1 run in 8 of rl_scale's world-2 FSDP step here, even after
    destroy_process_group). So whatever must outlive the rank is written before this call. Not on an error
    path: a peer may still be in a collective."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def split_by_tokens(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Row indices per rank with similar token counts: longest rows first, each to the rank with the fewest
    tokens so far (ties: the lower rank). Deterministic, so every rank computes the same split."""
    loads: list[int] = [0] * size
    parts: list[list[int]] = [[] for _ in range(size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(size), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += lengths[i]
    return [sorted(p) for p in parts]


def shard(model: nn.Module, device: torch.device, mixed_precision: bool | None = None,
          expert_parallel: bool = True) -> nn.Module:  # fmt: skip
    """FSDP2 over the whole world: each decoder layer, the embedding and the lm_head are their own units, the
    rest (final norm) the root's. Parameters stay float32 on CPU; on devices they are gathered in bf16 with
    fp32 gradient reduction unless `mixed_precision` is False. Gradients are summed, not averaged: each rank's
    loss is already its share of the batch's. `expert_parallel`: the routed experts are split over the world by
    expert and never gathered; the tokens travel to them (glm5_trainer.experts). Without it FSDP2 gathers
    every expert of a layer onto every rank for the layer's forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from glm5_trainer.experts import parallelize_experts

    use_mp = device.type != "cpu" if mixed_precision is None else mixed_precision
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_mp else None
    size = dist.get_world_size() if dist.is_initialized() else 1
    # one mesh for FSDP2's parameters and the experts': the optimizer's foreach steps take them together
    mesh = init_device_mesh(device.type, (size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if policy is not None:
        kwargs["mp_policy"] = policy
    if expert_parallel:
        # its own group: the exchanges never queue behind FSDP2's prefetched gathers on the world's
        group = dist.new_group(backend=backend_for(device)) if dist.is_initialized() else None
        kwargs["ignored_params"] = parallelize_experts(model, mesh, group, torch.bfloat16 if use_mp else None)
    inner = model.get_submodule("model")
    layers = inner.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList)
    units: list[nn.Module] = [inner.get_submodule("embed_tokens"), *layers, model.get_submodule("lm_head")]
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # float32 gradients would go out as PREMUL_SUM(1/factor), which gloo does not have (float64 and
            # other dtypes are summed, then scaled, already)
            module.set_force_sum_reduction_for_comms(backend_for(device) == "gloo")
    return model


def build_sharded(path: Path, dtype: torch.dtype, device: torch.device, expert_parallel: bool = True,
                  **extra: Any) -> tuple[Any, int]:  # fmt: skip
    """transformers' GlmMoeDsaForCausalLM for `path`, built on the meta device, sharded over the world (`shard`)
    and filled from the checkpoint with this rank's rows only: no rank ever holds the whole model, nor reads
    more of the files than its shards (and the small replicated buffers). Returns (model, bytes read)."""
    from transformers import AutoConfig, GlmMoeDsaForCausalLM

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None) or getattr(config, "tie_word_embeddings", False):
        raise ConfigError(f"{path}: a sharded trainer loads float checkpoints with untied embeddings")
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM._from_config(config, dtype=dtype, **extra)  # type: ignore[no-untyped-call]
    shard(model, device, expert_parallel=expert_parallel)
    model.to_empty(device=device)
    return model, load_own_shards(model, path)


def load_own_shards(model: nn.Module, path: Path) -> int:
    """Copies the checkpoint at `path` into a sharded model whose storage is allocated but not set (to_empty):
    for each parameter only the rows of dim 0 this rank holds (FSDP2 shards dim 0 as torch.chunk does), read
    with safetensors' get_slice; stacked experts from the per-expert tensors on disk (`on_disk`'s inverse);
    buffers whole; buffers a checkpoint does not store (RoPE frequencies) computed again from the config.
    Returns the bytes read."""
    from safetensors import safe_open

    handles: dict[Path, Any] = {file: safe_open(str(file), "pt") for file in checkpoint_files(path)}
    files = {name: file for file, handle in handles.items() for name in handle.keys()}  # noqa: SIM118
    read = 0

    def rows(name: str, a: int, b: int | None) -> torch.Tensor:
        nonlocal read
        if name not in files:
            raise ConfigError(f"{path}: the checkpoint has no tensor {name}")
        t: torch.Tensor = handles[files[name]].get_slice(name)[a:b]
        read += t.numel() * t.element_size()
        return t

    def experts(prefix: str, part: str, a: int, b: int) -> torch.Tensor:
        return torch.stack([rows(f"{prefix}.{e}.{part}.weight", 0, None) for e in range(a, b)])

    config: Any = model.config
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            n = param.shape[0]
            a = min(rank * math.ceil(n / size), n) if isinstance(param, DTensor) else 0
            b = a + local.shape[0]
            if name.endswith(".experts.gate_up_proj") and name not in files:
                prefix = name.removesuffix(".gate_up_proj")
                value = torch.cat([experts(prefix, "gate_proj", a, b), experts(prefix, "up_proj", a, b)], dim=1)
            elif name.endswith(".experts.down_proj") and name not in files:
                value = experts(name.removesuffix(".down_proj"), "down_proj", a, b)
            else:
                value = rows(name, a, b)
            if value.shape != local.shape:
                raise ConfigError(f"{path}: {name} rows {a}:{b} have shape {tuple(value.shape)}, the model's shard "
                                  f"{tuple(local.shape)}")  # fmt: skip
            local.copy_(value)
        for module in model.modules():
            own = dict(module.named_buffers(recurse=False))
            missing = set(module._non_persistent_buffers_set) & set(own)
            fresh = type(module)(config=config) if missing else None  # RoPE: computed from the config, not stored
            for bname, buf in own.items():
                if bname in missing:
                    buf.copy_(getattr(fresh, bname))
        for name, buf in model.named_buffers():
            if name in files:
                buf.copy_(rows(name, 0, None))
    return read


def all_sum(values: Sequence[float]) -> list[float]:
    """Sums a few numbers over the world (float64, one collective); in a world of one, the numbers."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter or gradient (the tensor itself when it is not sharded)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_norm(t: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a whole (possibly sharded) tensor, the same on every rank."""
    n = torch.linalg.vector_norm(t)
    return n.full_tensor() if isinstance(n, DTensor) else n


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (what sharding divides by the world)."""
    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters() if p.grad is not None)
    moments = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            moments += sum(local(v).numel() * local(v).element_size() for v in state.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0)  # fmt: skip
    return {"parameters": params, "gradients": grads, "optimizer": moments}


class Commands:
    """Rank 0 tells the other ranks what to run next: a name and its arguments, pickled and broadcast on a gloo
    group of its own. Its timeout is the leader's longest silence (evaluations, waits for rollouts), not a
    collective's: the training collectives keep the world's short one. A leader that dies closes its sockets,
    and the followers' wait fails at once."""

    def __init__(self, world: World, idle_timeout_s: float = 7 * 86400.0) -> None:
        self.world = world
        self.group = (
            dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=idle_timeout_s))
            if world.size > 1
            else None
        )

    def send(self, name: str, *args: Any) -> None:
        if self.group is not None:
            dist.broadcast_object_list([(name, args)], src=0, group=self.group)

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        name, args = box[0]
        return str(name), tuple(args)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if self.group is None:
            return [value]
        out: list[Any] = [None] * self.world.size
        dist.all_gather_object(out, value, group=self.group)
        return out


@dataclasses.dataclass(frozen=True)
class _Unit:
    """Tensors of the published checkpoint that one rank writes together: an entry whole (gathered first when
    `gather`), or the experts of a stacked entry that one rank's shard holds whole (`owner`, nothing gathered)."""

    entry: str
    keys: tuple[str, ...]
    nbytes: int
    owner: int | None  # None: any rank may write it (the plan balances them)
    gather: bool


def _units(model: nn.Module, size: int) -> list[_Unit]:
    config: Any = model.config  # both models carry their HF config
    inter = int(config.moe_intermediate_size)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    units: list[_Unit] = []
    for name, t in sorted(model.state_dict().items()):
        pieces = [(k, part, parts) for k, part, parts in layout(name, t, size, inter)
                  if not (tied and k == "lm_head.weight")]  # fmt: skip
        if len(pieces) == 1 and pieces[0][0] == name:
            units.append(_Unit(name, (name,), t.numel() * t.element_size(), None, isinstance(t, DTensor)))
            continue
        owners: dict[int, list[tuple[str, int]]] = {}
        for key, part, parts in pieces:  # a stacked entry: each expert whole on one rank (layout's owner)
            owners.setdefault(parts[0][0], []).append((key, part.numel() * part.element_size()))
        units += [_Unit(name, tuple(k for k, _ in keys), sum(b for _, b in keys), owner, False)
                  for owner, keys in sorted(owners.items())]  # fmt: skip
    return units


def checkpoint_plan(model: nn.Module, size: int, max_shard_bytes: int = 2 << 30) -> list[tuple[int, list[_Unit]]]:
    """The published checkpoint's files as (writing rank, its units), the same on every rank (from names and
    shapes alone). Each rank writes the experts it holds; the other entries go to the least loaded rank, and a
    rank's gathered entries and its own are in separate files, so that only the first kind waits on the others.
    A file stays under `max_shard_bytes` (a larger unit goes alone)."""
    units = _units(model, size)
    load = [0] * size
    for u in units:
        if u.owner is not None:
            load[u.owner] += u.nbytes
    assigned = {id(u): u.owner for u in units}
    for u in sorted((u for u in units if u.owner is None), key=lambda u: (-u.nbytes, u.entry)):
        r = min(range(size), key=lambda r: (load[r], r))
        assigned[id(u)] = r
        load[r] += u.nbytes
    files: list[tuple[int, list[_Unit]]] = []
    for gather in (True, False):
        for r in range(size):
            used = 0
            start = len(files)
            for u in units:
                if assigned[id(u)] != r or u.gather != gather:
                    continue
                if len(files) == start or (files[-1][1] and used + u.nbytes > max_shard_bytes):
                    files.append((r, []))
                    used = 0
                files[-1][1].append(u)
                used += u.nbytes
    return files


def write_checkpoint(model: nn.Module, folder: Path, max_shard_bytes: int = 2 << 30) -> dict[str, int]:
    """The model's weights as HuggingFace safetensors shards (experts split per expert, as GLM-5 checkpoints
    store them) that every rank writes together into `folder`, which must exist (`checkpoint_plan`). A rank
    writes the experts its shard holds as they are; an entry sharded by rows is gathered (its full_tensor, a
    collective every rank joins, one tensor at a time) and kept by the rank that writes it. So no process holds
    more than its own file plus one tensor, and no expert is ever gathered. Rank 0 writes the index (more than
    one file) once every rank has written; the config and the rest are the caller's. Returns this rank's files,
    bytes written and bytes gathered."""
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    config: Any = model.config
    inter = int(config.moe_intermediate_size)
    state = model.state_dict()
    plan = checkpoint_plan(model, size, max_shard_bytes)
    mine = held(model, rank, size)
    stats = {"files": 0, "bytes": 0, "gathered": 0}
    weight_map: dict[str, str] = {}
    # the files with gathered entries first, in the same order on every rank (their collectives must match);
    # then each rank writes the rest of its own without waiting for anyone
    for i, (owner, members) in enumerate(plan):
        if owner != rank and not any(u.gather for u in members):
            continue
        fname = "model.safetensors" if len(plan) == 1 else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for u in members:
            t = state[u.entry].detach()
            if u.gather:
                full = t.full_tensor()
                stats["gathered"] += full.numel() * full.element_size()
                if owner == rank:
                    tensors[u.entry] = full
            elif owner == rank:
                if u.keys == (u.entry,):
                    tensors[u.entry] = mine.get(u.entry, t)  # a replicated entry: every rank has it whole
                else:
                    tensors.update({k: mine[k] for k in u.keys})
        if owner != rank:
            continue
        out = {key: part.to("cpu").contiguous()
               for name, t in tensors.items() for key, part in on_disk(name, t, inter).items()}  # fmt: skip
        save_file(out, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, fname))
        stats["files"] += 1
        stats["bytes"] += sum(v.numel() * v.element_size() for v in out.values())
    maps = [weight_map]
    if size > 1:
        maps = [{} for _ in range(size)]
        dist.all_gather_object(maps, weight_map)
    if rank == 0 and len(plan) > 1:
        merged = {k: v for m in maps for k, v in m.items()}
        total = sum(u.nbytes for _, members in plan for u in members)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(merged.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return stats
