"""Tensor parallelism: which slice of the model a rank holds, and the collectives its forward pass needs.

One model replica runs on `size` ranks. Every rank holds (Megatron-LM / vLLM's layout):
- attention heads [rank * H/N, (rank + 1) * H/N): q_b_proj and kv_b_proj rows, o_proj columns (its partial
  output is summed over ranks by an all-reduce); q_a / kv_a projections, their norms and the DSA indexer are
  replicated, so every rank picks the same top-k tokens from the same hidden states;
- with expert parallelism, the routed experts [rank * E/N, (rank + 1) * E/N) (expert e on rank e * N // E),
  without it a 1/N slice of every expert's intermediate dimension; the router is replicated; shared experts
  and dense MLPs are split by their intermediate dimension (column- then row-parallel);
- the vocabulary rows [rank * V/N, (rank + 1) * V/N) of the embedding and the LM head.
Per decoder layer that is two all-reduces of the hidden states (after attention, after the MLP), plus one for
the embedding and a gather of the logits per step.

`SINGLE` (size 1) makes every collective a no-op, so a one-device model runs the code it always ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from glm5.errors import ConfigError
from glm5.model.config import ModelConfig


@dataclass(slots=True)
class CommStats:
    """What the collectives of this rank moved and how long it waited for them (for benchmarks/GetStats)."""

    calls: int = 0
    bytes: int = 0  # payload bytes handed to collectives (a tensor's size, whatever the algorithm sends)
    seconds: float = 0.0

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0


@dataclass(slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = True
    group: Any = None  # the torch.distributed process group of the replica's devices (None: the default one)
    comm: CommStats = field(default_factory=CommStats)
    # all-reduce as an all-gather plus a sum in rank order: gloo's own all-reduce took 1.1-1.7 ms for any size
    # up to 256 KiB between two local processes here, its all-gather 0.3 ms (the sum is the same on every rank)
    reduce_by_gather: bool = False

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def span(self, total: int) -> tuple[int, int]:
        """This rank's [start, stop) of `total` items split evenly (checked divisible by `check_divisible`)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; the result is bit-identical on every rank (the top-k choices rely on it)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        if self.reduce_by_gather:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            total = parts[0]
            for part in parts[1:]:
                total += part
            x.copy_(total)
        else:
            dist.all_reduce(x, group=self.group)
        self._count(x, start)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0 gets the ranks' slices concatenated along the last dimension (vocabulary-parallel logits);
        other ranks get their own slice back."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, group=self.group, group_dst=0)
        self._count(x, start)
        return torch.cat(parts, dim=-1) if parts is not None else x

    def _count(self, x: torch.Tensor, start: float) -> None:
        self.comm.calls += 1
        self.comm.bytes += x.numel() * x.element_size()
        self.comm.seconds += time.perf_counter() - start


SINGLE = TensorParallel()


def check_divisible(config: ModelConfig, size: int, expert_parallel: bool) -> None:
    """Raises ConfigError naming the first model dimension that does not split over `size` ranks."""
    if size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {size}")
    if size == 1:
        return
    needs = [
        ("num_attention_heads", config.num_attention_heads),
        ("vocab_size", config.vocab_size),
    ]
    if "dense" in config.mlp_layer_types:
        needs.append(("intermediate_size", config.intermediate_size))
    if "sparse" in config.mlp_layer_types:
        needs.append(("shared experts' intermediate size (moe_intermediate_size x n_shared_experts)",
                      config.moe_intermediate_size * config.n_shared_experts))  # fmt: skip
        if expert_parallel:
            needs.append(("n_routed_experts", config.n_routed_experts))
        else:
            needs.append(("moe_intermediate_size", config.moe_intermediate_size))
    for name, value in needs:
        if value % size:
            raise ConfigError(
                f"tensor parallel size {size} does not divide {name} ({value}): choose a size that divides it"
            )
