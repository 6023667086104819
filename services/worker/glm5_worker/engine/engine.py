"""The synchronous engine: requests in, one model step at a time, per-request outputs out.

`AsyncEngine` (async_engine.py) drives it from a background thread for the gRPC server; tests and the
benchmarks drive it directly.
"""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from glm5.devices import available_memory, resolve_device
from glm5.errors import CapacityError, ConfigError, InvalidRequestError
from glm5.kernels import checked, kernels_for
from glm5.kvcache.storage import PagedKVStorage
from glm5.model.attention import DSAControls
from glm5.model.batch import DecodeGroup, ForwardBatch, PrefillChunk
from glm5.model.config import ModelConfig, RopeConfig
from glm5.model.loader import load_model, parse_dtype
from glm5.model.model import GlmMoeDsaForCausalLM
from glm5.model.presets import default_model_path
from glm5.tokenizer import IncrementalDetokenizer, Tokenizer

from glm5_worker.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from glm5_worker.engine.sampler import Sampler, token_logprob
from glm5_worker.engine.scheduler import ScheduledStep, Scheduler
from glm5_worker.engine.sequence import FinishReason, SamplingParams, Sequence, TokenLogprob
from glm5_worker.engine.sparsity import SparsityController
from glm5_worker.engine.structured import Grammars
from glm5_worker.engine.validation import Limits, validate_params, validate_prompt_ids
from glm5_worker.engine.weights import swap_in_place
from glm5_worker.kv.block_manager import BlockManager, KVStats
from glm5_worker.kv.sizing import auto_bytes, make_layout, plan_pool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]
    finish_reason: FinishReason
    stop_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    weight_version: int

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE


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


@dataclass(slots=True)
class _StepTimes:
    window: int
    decode_ms: deque[float] = field(default_factory=deque)

    def add(self, ms: float) -> None:
        self.decode_ms.append(ms)
        while len(self.decode_ms) > self.window:
            self.decode_ms.popleft()


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        model_dir = Path(config.model) if config.model else default_model_path()
        self.model_dir = model_dir
        dtype_name = (
            config.dtype if config.dtype != "auto" else ("float32" if self.device.type == "cpu" else "bfloat16")
        )
        self.dtype = parse_dtype(dtype_name)
        # the L1 cache may be narrower than the model: it is read back into the model dtype for attention
        self.kv_dtype = parse_dtype(config.kv_cache_dtype) if config.kv_cache_dtype != "auto" else self.dtype
        self.index_dtype = parse_dtype(config.kv_index_dtype) if config.kv_index_dtype != "auto" else self.kv_dtype
        rope = self._rope_override(ModelConfig.from_file(model_dir))
        self.model = load_model(model_dir, self.dtype, self.device, rope=rope)
        self.model_config: ModelConfig = self.model.config
        self.tokenizer = Tokenizer(model_dir)
        self.served_model_name = config.served_model_name or model_dir.name
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = sorted(set(self.model_config.eos_token_id) | set(self.tokenizer.eos_token_ids()))
        mc = self.model_config
        self.kernels = checked(
            kernels_for(self.device, config.kernels), config.kernels, self.device,
            (mc.num_attention_heads, mc.kv_lora_rank, mc.qk_rope_head_dim, mc.index_n_heads, mc.index_head_dim),
            self.dtype,
        )  # fmt: skip
        self.controls = DSAControls(
            dense_warmup_tokens=config.dense_warmup_tokens, paged_scoring_min_tokens=config.paged_scoring_min_tokens
        )
        if config.dense_warmup_tokens > 0 and config.dense_warmup_tokens > self.model_config.index_topk:
            log.warning(
                "dense warm-up (%d tokens) exceeds index_topk (%d): early tokens attend more than the model was "
                "trained with",
                config.dense_warmup_tokens,
                self.model_config.index_topk,
            )
        self._init_kv()
        self.sampler = Sampler(config.seed, self.device)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
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
        self.generated_tokens_total = 0
        self._times = _StepTimes(config.jitter_window)

    # set-up -------------------------------------------------------------------------------------------------
    def _rope_override(self, base: ModelConfig) -> RopeConfig | None:
        c = self.config
        if c.rope_scaling is None:
            return None
        assert c.rope_factor is not None
        original = c.rope_original_max_position_embeddings or base.max_position_embeddings
        return RopeConfig(
            rope_type=c.rope_scaling,
            rope_theta=base.rope.rope_theta,
            factor=c.rope_factor,
            original_max_position_embeddings=original if c.rope_scaling == "yarn" else None,
        )

    def _max_model_len(self) -> int:
        mc, c = self.model_config, self.config
        limit = mc.max_position_embeddings
        if c.rope_scaling is not None:
            assert c.rope_factor is not None
            limit = int((c.rope_original_max_position_embeddings or mc.max_position_embeddings) * c.rope_factor)
        if c.max_model_len is None:
            return min(DEFAULT_MAX_MODEL_LEN, limit)
        if c.max_model_len > limit:
            raise ConfigError(
                f"--max-model-len {c.max_model_len} exceeds the {limit} positions this checkpoint supports; "
                "add RoPE scaling (--rope-scaling yarn --rope-factor N) or lower it"
            )
        return c.max_model_len

    def _init_kv(self) -> None:
        c, mc = self.config, self.model_config
        chunk = c.max_num_batched_tokens
        l1 = c.l1_tokens if c.kv_int8_tier else 0
        total = c.kv_cache_bytes
        if total is None:
            cap = c.kv_cpu_max_bytes if self.device.type == "cpu" else None
            fraction = 0.5 if self.device.type == "cpu" else c.kv_memory_fraction
            total = auto_bytes(
                mc, self.kv_dtype, available_memory(self.device), fraction, cap, c.block_size, self.max_model_len,
                c.max_num_seqs, chunk, l1, c.kv_int8_tier, self.index_dtype,
            )  # fmt: skip
        self.pool_plan = plan_pool(
            mc, self.kv_dtype, total, c.block_size, self.max_model_len, c.max_num_seqs, chunk, l1, c.kv_int8_tier,
            self.index_dtype,
        )  # fmt: skip
        p = self.pool_plan
        layout = make_layout(
            mc, c.block_size, p.num_fp_blocks, p.num_q_blocks, self.kv_dtype, self.device, self.index_dtype
        )
        self.storage = PagedKVStorage(layout)
        self.blocks = BlockManager(p.num_fp_blocks, p.num_q_blocks, c.block_size, l1, c.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, c.max_num_seqs, c.max_num_batched_tokens)
        log.info(
            "KV pool: %d L1 + %d L2 blocks of %d tokens (%.1f MiB, %d tokens)",
            p.num_fp_blocks, p.num_q_blocks, c.block_size, p.total_bytes / 2**20, p.capacity_tokens,
        )  # fmt: skip

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
        ids = prompt_token_ids if prompt_token_ids else self.tokenizer.encode(prompt or "", add_special_tokens)
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

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def swap_weights(self, new_model: GlmMoeDsaForCausalLM, version: int) -> float:
        """Between two steps: copy `new_model`'s weights into the live model and forget cached prefixes.
        Returns the seconds it took (the pause the running requests see)."""
        if version <= self.weight_version:
            raise ConfigError(f"weight version must increase: serving {self.weight_version}, got {version}")
        start = time.perf_counter()
        swap_in_place(self.model, new_model)
        self.blocks.drop_prefix_cache(list(self.requests.values()))
        self.weight_version = version
        return time.perf_counter() - start

    # the step -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        start = time.perf_counter()
        batch, rows = self._build_batch(sched)
        self.num_steps += 1
        batch.collect_entropy = self.num_steps % self.config.entropy_interval == 0
        batch.layer_topk = self.sparsity.layer_topk()
        with torch.inference_mode():
            logits = self.model(batch, self.storage, self.kernels, self.controls)
        if batch.entropy:
            self.sparsity.observe(batch.entropy)
        outputs = self._postprocess(sched, logits, rows)
        if sched.decodes:
            self._times.add((time.perf_counter() - start) * 1000.0)
        return outputs

    def _build_batch(self, sched: ScheduledStep) -> tuple[ForwardBatch, dict[int, list[int]]]:
        """Packs decodes then prefill chunks; `rows` maps id(seq) to its rows in the logits."""
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        rows: dict[int, list[int]] = {}
        decode = None
        if sched.decodes:
            ctx = []
            for seq in sched.decodes:
                p = seq.num_computed_tokens
                ids.append(_token_at(seq, p))
                positions.append(p)
                slots.append(self.blocks.slot(seq, p))
                ctx.append(p + 1)
                rows[id(seq)] = [len(logit_rows)]
                logit_rows.append(len(ids) - 1)
            width = max(len(s.block_table) for s in sched.decodes)
            tables = torch.zeros(len(sched.decodes), width, dtype=torch.long)
            for i, seq in enumerate(sched.decodes):
                tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table)
            decode = DecodeGroup(
                len(sched.decodes),
                tables.to(self.device),
                torch.tensor(ctx, device=self.device),
                max(ctx),
                tables=[s.block_table for s in sched.decodes],
                lengths=ctx,
            )
        prefills = []
        for seq, n in sched.prefills:
            p0 = seq.num_computed_tokens
            start = len(ids)
            all_ids = seq.all_token_ids
            ids.extend(all_ids[p0 : p0 + n])
            positions.extend(range(p0, p0 + n))
            slots.extend(self.blocks.slot(seq, p) for p in range(p0, p0 + n))
            nblocks = -(-(p0 + n) // bs)
            table = torch.tensor(seq.block_table[:nblocks], dtype=torch.long, device=self.device)
            prefills.append(PrefillChunk(start, n, p0 + n, table))
            wanted = list(range(start, start + n)) if seq.params.prompt_logprobs else []
            if p0 + n == seq.num_tokens and not wanted:
                wanted = [start + n - 1]
            rows[id(seq)] = list(range(len(logit_rows), len(logit_rows) + len(wanted)))
            logit_rows.extend(wanted)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode=decode,
            prefills=prefills,
            logits_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )
        return batch, rows

    def _postprocess(
        self, sched: ScheduledStep, logits: torch.Tensor, rows: dict[int, list[int]]
    ) -> list[RequestOutput]:
        to_sample: list[Sequence] = []
        sample_rows: list[int] = []
        for seq in sched.decodes:
            seq.num_computed_tokens += 1
            to_sample.append(seq)
            sample_rows.append(rows[id(seq)][0])
        for seq, n in sched.prefills:
            p0 = seq.num_computed_tokens
            seq.num_computed_tokens += n
            r = rows[id(seq)]
            if seq.params.prompt_logprobs and r:
                self._prompt_logprobs(seq, logits[r[0] : r[-1] + 1], p0)
            if seq.num_computed_tokens == seq.num_tokens:
                to_sample.append(seq)
                sample_rows.append(r[-1])
        if to_sample:
            picks = self.sampler.sample(logits[sample_rows], to_sample)
            for seq, pick in zip(to_sample, picks, strict=True):
                self._append_token(seq, pick)
        scheduled = [*sched.decodes, *(s for s, _ in sched.prefills)]
        copies: list[tuple[int, int]] = []
        for seq in scheduled:
            if not seq.is_finished:
                self.blocks.register_full_blocks(seq)
                copies.extend(self.blocks.demote(seq))
        if copies:
            fp, q = zip(*copies, strict=True)
            self.storage.demote(torch.tensor(fp, device=self.device), torch.tensor(q, device=self.device))
        outputs = []
        for seq in scheduled:
            out = self._drain(seq)
            if out is not None:
                outputs.append(out)
            if seq.is_finished:
                self.scheduler.remove(seq)
                self.requests.pop(seq.request_id, None)
        return outputs

    def _prompt_logprobs(self, seq: Sequence, chunk_logits: torch.Tensor, p0: int) -> None:
        lp = torch.log_softmax(chunk_logits.float(), dim=-1)
        prompt = seq.prompt_ids
        for i in range(lp.shape[0]):
            target = p0 + i + 1
            if target < len(prompt):
                seq.prompt_logprobs.append(token_logprob(lp[i], prompt[target], seq.params.top_logprobs))

    def _append_token(self, seq: Sequence, pick: TokenLogprob) -> None:
        token = pick.token_id
        params = seq.params
        seq.output_ids.append(token)
        seq.new_token_ids.append(token)
        if params.logprobs:
            seq.new_logprobs.append(pick)
        self.generated_tokens_total += 1
        grammar_done = self._advance_format(seq, token)
        if not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, self.tokenizer.id_to_token(token) or str(token)
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, str(token)
        else:
            seq.pending_text += seq.detokenizer.add(token)
            if seq.detokenizer.stopped_by is not None:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, seq.detokenizer.stopped_by
            elif grammar_done:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, "structured_output"
            elif len(seq.output_ids) >= params.max_new_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = FinishReason.LENGTH
        if seq.is_finished:
            seq.pending_text += seq.detokenizer.flush()

    @staticmethod
    def _advance_format(seq: Sequence, token: int) -> bool:
        """Feeds a sampled token to the sequence's format; True once the format is complete."""
        fmt, matcher = seq.params.output_format, seq.matcher
        if matcher is None or fmt is None:
            return False
        if seq.format_phase == "thinking":
            if token == fmt.think_close:
                seq.format_phase = "format"
            return False
        if seq.format_phase == "start":
            if token == fmt.think_open:
                seq.format_phase = "thinking"
                return False
            seq.format_phase = "format"
        if not matcher.consume_token(token):
            log.warning("%s: structured output stopped: %s", seq.request_id, matcher.get_error())
            return True
        return matcher.is_stopped()

    def _drain(self, seq: Sequence) -> RequestOutput | None:
        pending_prompt = seq.params.prompt_logprobs and not seq.prompt_logprobs_sent and seq.output_ids
        if not seq.new_token_ids and not seq.is_finished and not pending_prompt:
            return None
        out = RequestOutput(
            request_id=seq.request_id,
            token_ids=seq.new_token_ids,
            text=seq.pending_text,
            logprobs=seq.new_logprobs,
            prompt_logprobs=seq.prompt_logprobs if pending_prompt else [],
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            cached_prompt_tokens=seq.num_cached_prompt_tokens,
            weight_version=self.weight_version,
        )
        if pending_prompt:
            seq.prompt_logprobs_sent = True
        seq.new_token_ids, seq.new_logprobs, seq.pending_text = [], [], ""
        return out

    # introspection ------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        times = list(self._times.decode_ms)
        layers = [(i, s.entropy_short or 0.0, s.drift, s.topk) for i, s in enumerate(self.sparsity.layers)]
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
        )


def _token_at(seq: Sequence, position: int) -> int:
    n = len(seq.prompt_ids)
    return seq.prompt_ids[position] if position < n else seq.output_ids[position - n]
