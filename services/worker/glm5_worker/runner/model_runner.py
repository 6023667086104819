"""What every rank of a replica runs: its device, its model shard, its copy of the KV cache, and the forward step.

Rank 0's engine decides each step (scheduler, block manager) and describes it as a `StepPlan`: plain lists of
ints, small to send to the other ranks, which turn it into the same `ForwardBatch` on their own devices. A
single-device worker is rank 0 of a replica of one.
"""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path

import torch
from glm5.devices import available_memory
from glm5.errors import CheckpointError
from glm5.kernels import checked, kernels_for
from glm5.kvcache.storage import PagedKVStorage
from glm5.model.attention import DSAControls
from glm5.model.batch import DecodeGroup, ForwardBatch, PrefillChunk
from glm5.model.loader import load_model, weight_bytes_by_dtype, weight_placement
from glm5.model.model import GlmMoeDsaForCausalLM
from glm5.parallel import TensorParallel

from glm5_worker.kv.sizing import PoolPlan, auto_bytes, make_layout, plan_pool
from glm5_worker.resolved import ResolvedConfig
from glm5_worker.runner.compiled import CompiledDecode, default_cache_dir
from glm5_worker.runner.compiled import unavailable as compiled_unavailable
from glm5_worker.runner.plan import RankMemory, StepPlan
from glm5_worker.runner.weights import swap_in_place

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, rc: ResolvedConfig, tp: TensorParallel, device: torch.device) -> None:
        self.rc, self.tp = rc, tp
        self.device = device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model: GlmMoeDsaForCausalLM = load_model(
            rc.model_dir,
            rc.dtype,
            self.device,
            progress=None if tp.is_first else False,
            rope=rc.model.rope,
            tp=tp,
            mtp="require" if rc.mtp_layers else "skip",
        )  # one progress bar per replica: rank 0's
        self.fused_projections = self.model.fuse_input_projections()
        self.weight_bytes_by_dtype = weight_bytes_by_dtype(self.model)
        self.weight_bytes = sum(self.weight_bytes_by_dtype.values())
        self._check_placement()
        formats = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(self.weight_bytes_by_dtype.items()))
        who = f"rank {tp.rank}/{tp.size}: " if tp.size > 1 else ""
        log.info("%s%.1f MiB of weights on %s (%s)", who, self.weight_bytes / 2**20, self.device, formats)
        mc = rc.model
        self.kernels = checked(
            kernels_for(self.device, rc.engine.kernels), rc.engine.kernels, self.device,
            (mc.num_attention_heads // tp.size, mc.kv_lora_rank, mc.qk_rope_head_dim, mc.index_n_heads,
             mc.index_head_dim),
            rc.dtype,
        )  # fmt: skip
        self.controls = DSAControls(
            dense_warmup_tokens=rc.engine.dense_warmup_tokens,
            paged_scoring_min_tokens=rc.engine.paged_scoring_min_tokens,
        )
        self.storage: PagedKVStorage | None = None
        self.compiled: CompiledDecode | None = None
        self.hidden: torch.Tensor | None = None  # the last step's hidden states (N, H), when its plan kept them

    def _check_placement(self) -> None:
        """Weights meant for an accelerator must be in its memory (a tensor left on the host would make every
        step copy it): by where the tensors are, and by what the device's allocator says it holds."""
        placed = weight_placement(self.model)
        if self.device.type == "cpu":
            return
        if placed["host"]:
            raise CheckpointError(
                f"{placed['host'] / 2**20:.1f} MiB of weights meant for {self.device} are in host memory"
            )
        allocated = device_allocated(self.device)
        if allocated is not None and allocated < placed["device"]:
            raise CheckpointError(
                f"{self.device} reports {allocated / 2**20:.1f} MiB allocated but the weights need "
                f"{placed['device'] / 2**20:.1f} MiB there"
            )

    # KV cache -----------------------------------------------------------------------------------------------
    def kv_budget(self) -> int:
        """Bytes this rank can give the KV pool (after its weights are loaded)."""
        c = self.rc.engine
        if c.kv_cache_bytes is not None:
            return c.kv_cache_bytes
        is_cpu = self.device.type == "cpu"
        # on one host the ranks share the host's memory: each may take its share of it
        share = self.rc.engine.ranks_per_node if is_cpu else 1
        return auto_bytes(
            self.rc.cache, available_memory(self.device) // share, 0.5 if is_cpu else c.kv_memory_fraction,
            c.kv_cpu_max_bytes if is_cpu else None,
        )  # fmt: skip

    def init_kv(self, total_bytes: int) -> PoolPlan:
        """Allocates the pool; every rank of a replica must be given the same bytes (so the same plan)."""
        plan = plan_pool(self.rc.cache, total_bytes)
        spec = self.rc.cache
        layout = make_layout(
            spec.model, spec.block_size, plan.num_fp_blocks, plan.num_q_blocks, spec.dtype, self.device,
            spec.index_dtype, spec.mtp_layers,
        )  # fmt: skip
        self.storage = PagedKVStorage(layout)
        return plan

    def decode_compiler(self) -> CompiledDecode | None:
        """This runner's compiled decode steps, not compiled yet (after init_kv: the graphs read and write this
        pool); None when its steps run eagerly: told so, or it cannot (the reason is logged)."""
        c = self.rc.engine
        if c.enforce_eager:
            return None
        reason = compiled_unavailable(self)
        if reason is not None:
            log.info("%s: decode steps run eagerly", reason)
            return None
        cache = Path(c.compile_cache_dir) if c.compile_cache_dir else default_cache_dir()
        return CompiledDecode(self, c.compile_max_batch, cache, c.compile_budget_s)

    def compile_decode(self) -> None:
        """Compiles the decode steps now, before the first step (Engine built directly: tests, benchmarks)."""
        compiled = self.decode_compiler()
        if compiled is not None:
            compiled.warm_up()
            self.compiled = compiled

    # the step -----------------------------------------------------------------------------------------------
    def batch(self, plan: StepPlan) -> ForwardBatch:
        dev = self.device
        decode = None
        if plan.decode_tables:
            width = max(len(t) for t in plan.decode_tables)
            tables = torch.zeros(len(plan.decode_tables), width, dtype=torch.long)
            for i, table in enumerate(plan.decode_tables):
                tables[i, : len(table)] = torch.tensor(table)
            decode = DecodeGroup(
                len(plan.decode_tables),
                tables.to(dev),
                torch.tensor(plan.decode_lengths, device=dev),
                max(plan.decode_lengths),
                tables=plan.decode_tables,
                lengths=plan.decode_lengths,
            )
        prefills = [
            PrefillChunk(start, length, ctx, torch.tensor(table, dtype=torch.long, device=dev))
            for start, length, ctx, table in plan.prefills
        ]
        return ForwardBatch(
            input_ids=torch.tensor(plan.input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(plan.positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(plan.slots, dtype=torch.long, device=dev),
            decode=decode,
            prefills=prefills,
            logits_rows=torch.tensor(plan.logits_rows, dtype=torch.long, device=dev),
            layer_topk=plan.layer_topk,
            collect_entropy=plan.collect_entropy,
        )

    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, dict[int, float]]:
        """Runs the step: logits (M, V) on rank 0 (a follower's own vocabulary slice elsewhere), and the
        per-layer attention entropy when the plan asked for it."""
        assert self.storage is not None, "init_kv first"
        self.hidden = None
        if self.compiled is not None:
            done = self.compiled.run(plan)
            if done is not None:
                logits, entropy, hidden = done
                self.hidden = hidden if plan.keep_hidden else None
                return logits, entropy
        batch = self.batch(plan)
        with torch.inference_mode():
            if plan.keep_hidden:
                self.hidden = self.model.hidden_states(batch, self.storage, self.kernels, self.controls)
                logits = self.model.logits(self.hidden[batch.logits_rows])
            else:
                logits = self.model(batch, self.storage, self.kernels, self.controls)
        return logits, {layer: float(e) for layer, e in batch.entropy.items()}

    def draft(self, plan: StepPlan, hidden: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An MTP pass (GlmMoeDsaForCausalLM.mtp_forward): row i of `plan` carries the token after its position
        and `hidden` (N, H) that position's hidden state. Returns the logits of plan.logits_rows and every row's
        output (the next recursive pass's hidden states)."""
        assert self.storage is not None, "init_kv first"
        if self.compiled is not None and step % len(self.model.mtp_layers) == 0:
            done = self.compiled.run_draft(plan, hidden)
            if done is not None:
                logits, out = done
                return logits[plan.logits_rows], out
        batch = self.batch(plan)
        with torch.inference_mode():
            return self.model.mtp_forward(batch, hidden, self.storage, self.kernels, self.controls, step)

    def demote(self, copies: list[tuple[int, int]]) -> None:
        """Copies L1 blocks into their L2 blocks (INT8), as the block manager decided."""
        assert self.storage is not None
        fp, q = zip(*copies, strict=True)
        self.storage.demote(torch.tensor(fp, device=self.device), torch.tensor(q, device=self.device))

    def swap_weights(self, new_model: GlmMoeDsaForCausalLM) -> None:
        swap_in_place(self.model, new_model)

    def memory(self) -> RankMemory:
        # ru_maxrss is in KiB on Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if os.name == "posix" else 0
        kv = self.storage.nbytes() if self.storage is not None else 0
        device = device_allocated(self.device) or 0
        return RankMemory(self.tp.rank, self.weight_bytes, kv, device, rss, dict(self.weight_bytes_by_dtype))


def device_allocated(device: torch.device) -> int | None:
    """Bytes the device's caching allocator holds for tensors (torch.cuda / torch_npu memory statistics); None
    on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if device.type == "npu":
        return int(torch.npu.memory_allocated(device))  # type: ignore[attr-defined]
    return None
