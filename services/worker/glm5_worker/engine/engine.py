"""The synchronous engine on rank 0: requests in, one model step at a time, per-request outputs out.

Parts, as in nano-vllm and vLLM: the Scheduler decides each step, the ModelRunner (one per rank) runs it on its
model shard, the OutputProcessor turns logits into tokens and outputs. With --tensor-parallel-size N the engine
starts ranks 1..N-1 (glm5_worker.parallel) and sends each step to them before running it itself.
`AsyncEngine` (async_engine.py) drives it from a background thread for the gRPC server; tests and the
benchmarks drive it directly.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from glm5.errors import CapacityError, CheckpointError, ConfigError, InvalidRequestError
from glm5.kernels.base import DSAKernels
from glm5.kvcache.storage import PagedKVStorage
from glm5.model.config import ModelConfig
from glm5.model.model import GlmMoeDsaForCausalLM
from glm5.parallel import SINGLE, TensorParallel
from glm5.tokenizer import IncrementalDetokenizer, Tokenizer

from glm5_worker.config import EngineConfig
from glm5_worker.engine.output_processor import OutputProcessor, RequestOutput, format_prefix
from glm5_worker.engine.sampler import Sampler
from glm5_worker.engine.scheduler import ScheduledStep, Scheduler
from glm5_worker.engine.sequence import FinishReason, SamplingParams, Sequence
from glm5_worker.engine.sparsity import SparsityController
from glm5_worker.engine.speculative import SpecCounters, can_speculate, draft_budget, draft_token, ngram_drafts
from glm5_worker.engine.structured import Grammars
from glm5_worker.engine.validation import Limits, validate_params, validate_prompt_ids
from glm5_worker.kv.block_manager import BlockManager, KVStats
from glm5_worker.kv.events import CacheDelta
from glm5_worker.parallel.driver import ReplicaDriver, start_replica
from glm5_worker.parallel.protocol import Draft
from glm5_worker.parallel.replica import ReplicaFailure
from glm5_worker.resolved import resolve
from glm5_worker.runner.compiled import CompiledDecode
from glm5_worker.runner.model_runner import ModelRunner
from glm5_worker.runner.plan import RankMemory, StepPlan
from glm5_worker.runner.weights import Forwarder, WeightSource

__all__ = ["Engine", "EngineStats", "RequestOutput"]
log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    kv: KVStats
    block_size: int
    num_running: int
    num_waiting: int
    token_latency_jitter_ms: float
    mean_token_latency_ms: float
    attention_entropy_drift: float
    layers: list[tuple[int, float, float, int]]  # (layer, entropy, drift, topk)
    generated_tokens_total: int
    weight_version: int
    num_preemptions: int
    ranks: list[RankMemory]  # one per rank of the replica
    speculative: SpecCounters | None = None  # drafted / accepted tokens, when the engine speculates
    cache: CacheDelta | None = None  # the prefix cache's events, when asked for (kv.events)


@dataclass(slots=True)
class _StepTimes:
    """The latest decode step times: at most `window` of them, none older than `window_s`. The age bound is what
    lets a worker recover: the router sends a worker whose jitter is over its threshold less traffic, and an idle
    worker's old samples would otherwise keep it marked (and, at low load, starved) for good."""

    window: int
    window_s: float
    clock: Callable[[], float] = time.monotonic
    decode_ms: deque[tuple[float, float]] = field(default_factory=deque)  # (when, ms)

    def add(self, ms: float) -> None:
        self.decode_ms.append((self.clock(), ms))
        while len(self.decode_ms) > self.window:
            self.decode_ms.popleft()

    def recent(self) -> list[float]:
        cutoff = self.clock() - self.window_s
        while self.decode_ms and self.decode_ms[0][0] < cutoff:
            self.decode_ms.popleft()
        return [ms for _, ms in self.decode_ms]


class Engine:
    # the resolved configuration's facts are read where they are kept (resolved.py), not copied

    @property
    def model_dir(self) -> Path:
        return self.resolved.model_dir

    @property
    def dtype(self) -> torch.dtype:
        return self.resolved.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.resolved.kv_dtype

    @property
    def index_dtype(self) -> torch.dtype:
        return self.resolved.index_dtype

    @property
    def max_model_len(self) -> int:
        return self.resolved.max_model_len

    @property
    def served_model_name(self) -> str:
        return self.resolved.served_model_name

    @property
    def model_config(self) -> ModelConfig:
        return self.resolved.model

    def __init__(self, config: EngineConfig, compile_now: bool = True) -> None:
        """`compile_now`: compile the decode steps before returning (False: the caller runs
        compile_in_background's job; AsyncEngine does, serving eagerly meanwhile)."""
        self.config = config
        rc = self.resolved = resolve(config)
        self.replica: ReplicaDriver | None = start_replica(rc) if config.tensor_parallel_size > 1 else None
        self._forwarder: Forwarder | None = None  # a pushed folder going to the replica's other hosts
        try:
            self.runner = ModelRunner(rc, self.tp, self.replica.device if self.replica else rc.device_for(0))
            kv = self.runner.kv_budget
            self._init_kv(self.replica.replica.agreed_kv_bytes(kv) if self.replica is not None else kv())
            if compile_now:
                self.runner.compile_decode()
        except BaseException:
            self.close()
            raise
        self.device = self.runner.device
        self.tokenizer = Tokenizer(rc.model_dir)
        eos_token_ids = sorted(set(self.model_config.eos_token_id) | set(self.tokenizer.eos_token_ids()))
        self.sampler = Sampler(config.seed, self.device, eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.sampler, eos_token_ids, self.max_model_len)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.spec = rc.engine.speculative  # `auto` resolved
        if self.spec is not None:
            self.outputs.spec = SpecCounters(self.spec.num_speculative_tokens, self.spec.method)
            log.info("speculative decoding: %s, up to %d draft tokens a step%s", self.spec.method,
                     self.spec.num_speculative_tokens, "" if self.spec.disable_by_batch_size is None else
                     f", off while more than {self.spec.disable_by_batch_size} sequences run")  # fmt: skip
        self.sparsity = SparsityController(
            self.model_config.num_hidden_layers,
            self.model_config.index_topk,
            self.model_config.full_indexer_layers,
            config.dynamic_sparsity,
            config.sparsity_entropy_threshold,
            config.sparsity_patience,
            config.sparsity_widen_factor,
        )
        self.limits = Limits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            is_ascend=self.device.type == "npu",
            ascend_temperature_floor=config.ascend_temperature_floor,
        )
        self.requests: dict[str, Sequence] = {}
        self.weight_version = 0
        self.num_steps = 0
        self._times = _StepTimes(config.jitter_window, config.jitter_window_s)
        # L1 -> L2 copies rank 0 made after a step; the followers make them before the next one
        self._pending_demotions: list[tuple[int, int]] = []
        self._scratch_block: int | None = None  # reserved for the decode-step compiler while it runs

    @property
    def tp(self) -> TensorParallel:
        return self.replica.tp if self.replica is not None else SINGLE

    @property
    def model(self) -> GlmMoeDsaForCausalLM:
        return self.runner.model

    @property
    def kernels(self) -> DSAKernels:
        return self.runner.kernels

    @property
    def storage(self) -> PagedKVStorage:
        """The runner's KV storage (benchmarks and tests read it)."""
        assert self.runner.storage is not None
        return self.runner.storage

    @property
    def eos_token_ids(self) -> list[int]:
        return self.outputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        self.outputs.eos_token_ids = ids
        self.sampler.eos_token_ids = ids

    @property
    def generated_tokens_total(self) -> int:
        return self.outputs.generated_tokens_total

    # set-up -------------------------------------------------------------------------------------------------
    def _init_kv(self, total_bytes: int) -> None:
        c = self.config
        self.pool_plan = p = self.runner.init_kv(total_bytes)
        l1 = self.resolved.cache.l1_tokens
        self.blocks = BlockManager(
            p.num_fp_blocks, p.num_q_blocks, c.block_size, l1, c.enable_prefix_caching, c.cache_event_log
        )
        self.scheduler = Scheduler(self.blocks, c.max_num_seqs, c.max_num_batched_tokens)
        log.info(
            "KV pool: %d L1 + %d L2 blocks of %d tokens (%.1f MiB%s, %d tokens)",
            p.num_fp_blocks, p.num_q_blocks, c.block_size, p.total_bytes / 2**20,
            " per rank" if self.replica is not None else "", p.capacity_tokens,
        )  # fmt: skip

    def compile_in_background(self) -> Callable[[], CompiledDecode] | None:
        """On the engine thread: the job that compiles the decode steps, to run on a thread of its own while this
        engine steps eagerly, then to hand to use_compiled; None when the steps run eagerly. The compiler writes
        its dummy tokens into a KV block reserved until then."""
        compiled = self.runner.decode_compiler()
        if compiled is None:
            return None
        self._scratch_block = block = self.blocks.reserve()
        log.info("decode steps compile on a thread of their own; steps run eagerly until every graph is built")

        def job() -> CompiledDecode:
            compiled.warm_up(block)
            return compiled

        return job

    def use_compiled(self, compiled: CompiledDecode | None) -> None:
        """Between two steps: from the next one, decode steps run through `compiled`'s graphs (None: the compile
        failed; they stay eager). Frees the compiler's scratch block."""
        if self._scratch_block is not None:
            self.blocks.release(self._scratch_block)
            self._scratch_block = None
        if compiled is None or not compiled.ready:
            log.warning("no compiled decode steps: every step runs eagerly")
            return
        self.runner.compiled = compiled
        log.info("decode steps now run compiled (%d of %d graphs; %d steps ran eagerly before)", len(compiled.ready),
                 len(compiled.shapes()), self.num_steps)  # fmt: skip

    def close(self) -> None:
        """Stops the replica's other ranks (nothing to do on one device)."""
        if self.replica is not None:
            self.replica.close()

    # requests -----------------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        add_special_tokens: bool = False,
    ) -> Sequence:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if prompt and prompt_token_ids:
            raise InvalidRequestError("prompt", "give either prompt or prompt_token_ids, not both")
        ids = prompt_token_ids or self.tokenizer.encode_bounded(prompt or "", self.max_model_len, add_special_tokens)
        validate_prompt_ids(ids, self.limits)
        params = validate_params(params, len(ids), self.limits)
        need = self.blocks.blocks_needed(len(ids) + params.max_new_tokens)
        if need > self.blocks.total_blocks:
            raise CapacityError(
                f"request needs {need} KV blocks but the pool has {self.blocks.total_blocks}; "
                "lower max_new_tokens or the prompt"
            )
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise CapacityError(f"{len(self.scheduler.waiting)} requests already waiting; retry later")
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, list(params.stop), params.skip_special_tokens),
        )
        if params.seed is not None:
            seq.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        if params.output_format is not None:
            seq.matcher = self.grammars.matcher(params.output_format)
            seq.format_phase = params.output_format.first_phase
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = FinishReason.ABORT
        self.scheduler.remove(seq)
        return True

    def abort_all(self, stop_reason: str) -> list[RequestOutput]:
        """Ends every request (shutdown); returns each one's final output."""
        outs = [self.outputs.aborted(seq, stop_reason, self.weight_version) for seq in self.scheduler.abort_all()]
        self.requests.clear()
        return outs

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # weights ------------------------------------------------------------------------------------------------
    @functools.cached_property
    def max_update_bytes(self) -> int:
        """What one weight update may bring: a few times the served weights (a float32 checkpoint of bf16 weights
        is twice their size), plus room for the config and tokenizer files."""
        return int(4 * self.runner.weight_bytes * self.tp.size + (64 << 20))  # this rank holds 1/tp of them

    def start_weight_update(self, source: WeightSource, version: int = 0, on_this_host: bool = False) -> None:
        """Tells the other ranks to start reading their shards from `source` (rank 0 reads its own meanwhile).
        `on_this_host`: the folder exists on this host only, so the ranks of the replica's other hosts receive
        their parts from this process (weights.Forwarder) instead of reading it."""
        if self.replica is None:
            return
        c = self.config
        if on_this_host and isinstance(source, str) and c.nnodes > 1:
            self._forwarder = Forwarder(source, version, self.tp, c.ranks_per_node, c.master_addr,
                                        c.collective_timeout_s, self.max_update_bytes)  # fmt: skip
            source = self._forwarder.source
        self.replica.load_weights(source, self.tokenizer.fingerprint)

    def swap_weights(
        self, new_model: GlmMoeDsaForCausalLM | None, version: int, failure: Exception | None = None
    ) -> float:
        """Between two steps: copy the new weights (every rank its shard) into the live model and forget cached
        prefixes; nothing changes unless every rank read its shard. `failure`: rank 0's own read failed.
        Returns the seconds it took (the pause the running requests see)."""
        if self.replica is not None:
            try:
                outcomes = self.replica.agree_weights(version, (failure is None, str(failure or "")))
            finally:  # every rank has read (or failed): what is still sending or waiting ends, off this thread
                if self._forwarder is not None:
                    threading.Thread(target=self._forwarder.close, name="glm5-forward-close", daemon=True).start()
                    self._forwarder = None
            if failure is not None:
                raise failure
            failed = [(rank, msg) for rank, (ok, msg) in enumerate(outcomes) if not ok]
            if failed:
                raise CheckpointError(f"rank {failed[0][0]} could not read its shard: {failed[0][1]}")
        elif failure is not None:
            raise failure
        assert new_model is not None
        if version <= self.weight_version:
            raise ConfigError(f"weight version must increase: serving {self.weight_version}, got {version}")
        start = time.perf_counter()
        self.runner.swap_weights(new_model)
        self.blocks.drop_prefix_cache(list(self.requests.values()))
        self.weight_version = version
        return time.perf_counter() - start

    # the step -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        start = time.perf_counter()
        plan, rows, starts = self._plan(sched)
        plan.keep_hidden = self.spec is not None and self.spec.method == "mtp"
        self.num_steps += 1
        plan.collect_entropy = self.num_steps % self.config.entropy_interval == 0
        plan.layer_topk = self.sparsity.layer_topk()
        if self.replica is None:
            logits, entropy = self.runner.execute(plan)
        else:
            logits, entropy = self._execute_replicated(plan)
        if entropy:
            self.sparsity.observe(entropy)
        self.outputs.process(sched, logits, rows)
        scheduled = [*sched.decodes, *(s for s, _ in sched.prefills)]
        if self.spec is not None:
            self._propose(scheduled, starts)
        copies: list[tuple[int, int]] = []
        for seq in scheduled:
            # a sequence that finished in this step leaves its blocks cached too (a one-token request's prompt)
            self.blocks.register_full_blocks(seq)
            if not seq.is_finished:
                copies.extend(self.blocks.demote(seq))
        if copies:
            self.runner.demote(copies)
            if self.replica is not None:
                self._pending_demotions.extend(copies)
        outputs = []
        for seq in scheduled:
            out = self.outputs.drain(seq, self.weight_version)
            if out is not None:
                outputs.append(out)
            if seq.is_finished:
                self.scheduler.remove(seq)
                self.requests.pop(seq.request_id, None)
        if sched.decodes:
            self._times.add((time.perf_counter() - start) * 1000.0)
        return outputs

    def _execute_replicated(self, plan: StepPlan) -> tuple[torch.Tensor, dict[int, float]]:
        """Sends the step to the other ranks and runs rank 0's part. Any failure leaves the ranks out of step
        (some may wait in a collective): the replica is lost, not just this step."""
        assert self.replica is not None
        plan.demotions, self._pending_demotions = self._pending_demotions, []
        self.replica.step(plan)
        try:
            return self.runner.execute(plan)
        except Exception as exc:
            raise ReplicaFailure(f"rank 0 failed a step: {exc}") from exc

    def idle(self) -> None:
        """Called while there is no work: keeps the other ranks' waits alive and checks they still run."""
        if self.replica is not None:
            demotions, self._pending_demotions = self._pending_demotions, []
            self.replica.tick(demotions)

    def _plan(self, sched: ScheduledStep) -> tuple[StepPlan, dict[int, list[int]], dict[int, tuple[int, int, bool]]]:
        """Packs decodes then prefill chunks; `rows` maps id(seq) to its rows in the logits, `starts` to its
        first row in the step, that row's position and whether it decodes. A decoding sequence with drafts has a
        decode row for its last token and one for each draft, each over the same blocks with its own context
        length."""
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        rows: dict[int, list[int]] = {}
        starts: dict[int, tuple[int, int, bool]] = {}
        tables: list[list[int]] = []
        lengths: list[int] = []
        for seq in sched.decodes:
            p = seq.num_computed_tokens
            starts[id(seq)] = (len(ids), p, True)
            rows[id(seq)] = list(range(len(logit_rows), len(logit_rows) + 1 + len(seq.draft_ids)))
            for i, token in enumerate([_token_at(seq, p), *seq.draft_ids]):
                ids.append(token)
                positions.append(p + i)
                slots.append(self.blocks.slot(seq, p + i))
                lengths.append(p + i + 1)
                tables.append(seq.block_table)
                logit_rows.append(len(ids) - 1)
        prefills = []
        for seq, n in sched.prefills:
            p0 = seq.num_computed_tokens
            start = len(ids)
            starts[id(seq)] = (start, p0, False)
            ids.extend(seq.all_token_ids[p0 : p0 + n])
            positions.extend(range(p0, p0 + n))
            slots.extend(self.blocks.slot(seq, p) for p in range(p0, p0 + n))
            prefills.append((start, n, p0 + n, seq.block_table[: -(-(p0 + n) // bs)]))
            wanted = list(range(start, start + n)) if seq.params.prompt_logprobs else []
            if p0 + n == seq.num_tokens and not wanted:
                wanted = [start + n - 1]
            rows[id(seq)] = list(range(len(logit_rows), len(logit_rows) + len(wanted)))
            logit_rows.extend(wanted)
        return StepPlan(ids, positions, slots, tables, lengths, prefills, logit_rows), rows, starts

    # speculative decoding -----------------------------------------------------------------------------------
    def _propose(self, scheduled: list[Sequence], starts: dict[int, tuple[int, int, bool]]) -> None:
        """After a step: the drafts each sequence about to decode verifies in the next one (its draft_ids).
        With MTP, the MTP layer first runs over every position the step computed (so its KV rows follow every
        sequence), then drafts recursively. Above disable_by_batch_size sequences in flight (vLLM's rule: the
        running ones, prefills included) nothing drafts and no MTP pass runs, so a large batch pays nothing for
        speculation; a sequence in such a step has a gap in its MTP rows and drafts by MTP no more (drafts
        attending to rows never written would only lower its acceptance, a health signal)."""
        spec = self.spec
        assert spec is not None
        off = spec.disable_by_batch_size is not None and len(self.scheduler.running) > spec.disable_by_batch_size
        if off and spec.method == "mtp":
            for seq in scheduled:
                seq.mtp_gap = True
        drafters: dict[int, int] = {}  # id(seq) -> drafts it may propose
        for seq in scheduled:
            if off or seq.is_finished or seq.num_uncomputed != 1 or not can_speculate(seq) or seq.mtp_gap:
                continue
            j = self._draft_slots(seq, draft_budget(seq, spec.num_speculative_tokens, self.max_model_len))
            if j:
                drafters[id(seq)] = j
        if spec.method == "ngram":
            for seq in scheduled:
                j = drafters.get(id(seq), 0)
                if j:
                    seq.draft_ids = ngram_drafts(seq.all_token_ids, j, spec.prompt_lookup_max, spec.prompt_lookup_min)
                    seq.draft_probs = [None] * len(seq.draft_ids)
        elif not off:
            self._mtp_drafts([s for s in scheduled if not s.is_finished and not s.mtp_gap], starts, drafters)
        for seq in scheduled:  # a greedy draft the format refuses is rejected: no verify rows for it and after
            if seq.draft_ids and seq.matcher is not None and seq.params.is_greedy:
                n = format_prefix(seq, seq.draft_ids)
                seq.draft_ids, seq.draft_probs = seq.draft_ids[:n], seq.draft_probs[:n]

    def _draft_slots(self, seq: Sequence, j: int) -> int:
        """Drafts whose verify rows (and MTP rows) have KV slots: blocks for them now, fewer when the pool is
        short (a draft never preempts anyone)."""
        while j and not self.blocks.ensure_slots(seq, j + 1):
            j = min(j - 1, len(seq.block_table) * self.config.block_size - seq.num_computed_tokens - 1)
        return max(j, 0)

    def _mtp_drafts(self, seqs: list[Sequence], starts: dict[int, tuple[int, int, bool]],
                    drafters: dict[int, int]) -> None:  # fmt: skip
        """The MTP pass over the positions the step computed (a decode row for each verified position, a chunk
        for each prefill chunk; the row for position q carries the token at q + 1 and the target's hidden state
        at q), then the drafts: the first from the pass, the others from the layer applied to its own output."""
        hidden = self.runner.hidden
        assert hidden is not None
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        lengths: list[int] = []
        take: list[int] = []  # the step's rows whose hidden states the pass reads, in the pass's row order
        last: dict[int, int] = {}  # id(seq) -> its last row in the pass
        computed = [(seq, *starts[id(seq)]) for seq in seqs]
        for seq, row, p0, _ in (c for c in computed if c[3]):  # decode rows first, as in any step
            for p in range(p0, seq.num_computed_tokens):
                ids.append(_token_at(seq, p + 1))
                positions.append(p)
                slots.append(self.blocks.slot(seq, p))
                lengths.append(p + 1)
                tables.append(seq.block_table)
            take.extend(range(row, row + seq.num_computed_tokens - p0))
            last[id(seq)] = len(ids) - 1
        prefills: list[tuple[int, int, int, list[int]]] = []
        for seq, row, p0, _ in (c for c in computed if not c[3]):
            end = seq.num_computed_tokens
            prefills.append((len(ids), end - p0, end, seq.block_table[: -(-end // bs)]))
            ids.extend(_token_at(seq, p + 1) for p in range(p0, end))
            positions.extend(range(p0, end))
            slots.extend(self.blocks.slot(seq, p) for p in range(p0, end))
            take.extend(range(row, row + end - p0))
            last[id(seq)] = len(ids) - 1
        if not ids:
            return
        order = [s for s in seqs if id(s) in drafters]
        plan = StepPlan(ids, positions, slots, tables, lengths, prefills, [last[id(s)] for s in order])
        logits, out = self._draft_pass(plan, hidden[take], Draft(plan, 0, take=take))
        out = out[plan.logits_rows]
        for i, seq in enumerate(order):
            token, q = draft_token(logits[i], seq, self.sampler)
            seq.draft_ids, seq.draft_probs = [token], [q]
        # one position further each time, the layer's own output standing in for the target's hidden state
        for step in range(1, max((drafters[id(s)] for s in order), default=0)):
            keep = [i for i, s in enumerate(order) if drafters[id(s)] > step]
            order, out = [order[i] for i in keep], out[keep]
            pos = [s.num_computed_tokens - 1 + step for s in order]
            plan = StepPlan([s.draft_ids[-1] for s in order], pos, [self.blocks.slot(s, p) for s, p in
                            zip(order, pos, strict=True)], [s.block_table for s in order], [p + 1 for p in pos], [],
                            list(range(len(order))))  # fmt: skip
            logits, out = self._draft_pass(plan, out, Draft(plan, step, keep=keep))
            for i, seq in enumerate(order):
                token, q = draft_token(logits[i], seq, self.sampler)
                seq.draft_ids.append(token)
                seq.draft_probs.append(q)

    def _draft_pass(self, plan: StepPlan, hidden: torch.Tensor, message: Draft) -> tuple[torch.Tensor, torch.Tensor]:
        """An MTP pass on rank 0, and on the other ranks of a replica (`message` says which rows they read)."""
        if self.replica is None:
            return self.runner.draft(plan, hidden, message.step)
        self.replica.draft(message)
        try:
            return self.runner.draft(plan, hidden, message.step)
        except Exception as exc:
            raise ReplicaFailure(f"rank 0 failed a draft pass: {exc}") from exc

    # introspection ------------------------------------------------------------------------------------------
    def stats(self, cache_after: tuple[int, int] | None = None) -> EngineStats:
        """`cache_after`: (epoch, seq) of the prefix-cache events the asker applied; their sequel comes along."""
        times = self._times.recent()
        layers = [(i, s.entropy_short or 0.0, s.drift, s.topk) for i, s in enumerate(self.sparsity.layers)]
        mine = self.runner.memory()
        return EngineStats(
            kv=self.blocks.stats(),
            block_size=self.config.block_size,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            token_latency_jitter_ms=statistics.pstdev(times) if len(times) > 1 else 0.0,
            mean_token_latency_ms=statistics.fmean(times) if times else 0.0,
            attention_entropy_drift=self.sparsity.max_drift,
            layers=layers,
            generated_tokens_total=self.generated_tokens_total,
            weight_version=self.weight_version,
            num_preemptions=self.scheduler.num_preemptions,
            ranks=self.replica.stats(mine) if self.replica is not None else [mine],
            speculative=self.outputs.spec.snapshot() if self.outputs.spec is not None else None,
            cache=self.blocks.cache_delta(*cache_after)
            if cache_after is not None and self.config.enable_prefix_caching
            else None,
        )


def _token_at(seq: Sequence, position: int) -> int:
    n = len(seq.prompt_ids)
    return seq.prompt_ids[position] if position < n else seq.output_ids[position - n]
