"""The glm5.v1.Worker gRPC service: protobuf in, engine calls, protobuf out, errors as status codes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
from glm5.errors import CapacityError, CheckpointError, ConfigError, InvalidRequestError, check_vocabulary
from glm5.serving import STREAM_ACCEPTED_KEY, RequestFailed, serve_multiplexed
from glm5.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from glm5.weight_sync import GROUP_NAME, MAX_SENDERS, split_address

from glm5_worker.engine.async_engine import AsyncEngine, EngineFailure, EngineStopped, ReplicaLost
from glm5_worker.engine.engine import EngineStats, RequestOutput
from glm5_worker.engine.sequence import SamplingParams, TokenLogprob
from glm5_worker.engine.speculative import SpecCounters
from glm5_worker.engine.structured import OutputFormat
from glm5_worker.kv.events import CacheDelta
from glm5_worker.parallel.replica import ReplicaFailure
from glm5_worker.runner.weights import SyncSpec, WeightSource
from glm5_worker.server.push import receive_push

log = logging.getLogger(__name__)
MAX_FORMAT_CHARS = 64 << 10  # the router's limit too (docs/security.md)
STATS_WAIT_S = 0.2  # GetStats waits this long for fresh stats before answering with the last ones


def sampling_from_proto(req: worker_pb2.GenerateRequest, default_max_new_tokens: int) -> SamplingParams:
    s = req.sampling
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
        logit_bias=dict(s.logit_bias),
        output_format=_output_format(s.structured_output) if s.HasField("structured_output") else None,
        seed=s.seed if s.HasField("seed") else None,
        max_new_tokens=s.max_new_tokens if s.HasField("max_new_tokens") else default_max_new_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        logprobs=req.return_logprobs or req.top_logprobs > 0,
        top_logprobs=req.top_logprobs,
        prompt_logprobs=req.return_prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )


def _output_format(so: common_pb2.StructuredOutput) -> OutputFormat:
    kind = so.WhichOneof("format")
    if kind is None:
        raise InvalidRequestError(
            "sampling.structured_output", "set one of json_schema, json_object, regex, lark_grammar"
        )
    spec = "" if kind == "json_object" else getattr(so, kind)
    if len(spec) > MAX_FORMAT_CHARS:  # compiling a format costs time and memory with its size
        raise InvalidRequestError(f"sampling.structured_output.{kind}", f"at most {MAX_FORMAT_CHARS} characters")
    return OutputFormat(
        kind,
        spec,
        think_open=so.think_open_token_id if so.HasField("think_open_token_id") else None,
        think_close=so.think_close_token_id if so.HasField("think_close_token_id") else None,
        starts_thinking=so.starts_thinking,
    )


def _logprobs(items: list[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in items
    ]


def response_from_output(out: RequestOutput) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        request_id=out.request_id,
        token_ids=out.token_ids,
        text=out.text,
        logprobs=_logprobs(out.logprobs),
        prompt_logprobs=_logprobs(out.prompt_logprobs),
        finish_reason=cast(Any, int(out.finish_reason)),
        stop_reason=out.stop_reason,
        usage=common_pb2.Usage(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_prompt_tokens=out.cached_prompt_tokens,
        ),
        weight_version=out.weight_version,
    )


def weights_location(location: str, root: Path | None) -> Path:
    """The checkpoint folder an UpdateWeights may load: under `root` after symlinks are followed (a relative
    location is taken from the root), never through '..'."""
    if root is None:
        raise InvalidRequestError("location", "this worker takes no weight updates: start it with --weights-root")
    if not location:
        raise InvalidRequestError("location", "required: a checkpoint folder under the weights root")
    path = Path(location)
    if ".." in path.parts:
        raise InvalidRequestError("location", "'..' is not allowed")
    real = (root / path).resolve()  # an absolute location replaces the root
    if not real.is_relative_to(root.resolve()):
        raise InvalidRequestError("location", f"must be inside the weights root {root} (symlinks are followed)")
    return real


class _NotNewer(Exception):
    """A weight update that is not newer than the served version."""


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: AsyncEngine, weights_root: Path | None = None) -> None:
        self.engine = engine
        self.weights_root = weights_root
        self._stats: list[EngineStats] = []  # the last stats computed
        self._weights_lock = asyncio.Lock()

    @functools.cached_property
    def default_max_new_tokens(self) -> int:
        # the engine is built after the service exists (the port is bound first); no RPC reaches it before. Read
        # once: every request asks, and EngineInfo is built whole each time
        return self.engine.info.default_max_new_tokens

    async def prime(self) -> None:
        """Computes the first stats, so GetStats always has some to answer with while a step runs."""
        with contextlib.suppress(ReplicaFailure):  # a lost replica answers UNAVAILABLE from the start
            self._stats[:] = [await asyncio.wrap_future(self.engine.stats())]

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        try:
            async for resp in self._generate(request):
                yield resp
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)

    async def GenerateStream(
        self, request_iterator: AsyncIterator[worker_pb2.GenerateStreamRequests], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateStreamResponses]:
        await context.send_initial_metadata(())  # the caller waits for it before writing (router: WorkerStream)
        async for resp in serve_multiplexed(self._generate, request_iterator):
            yield resp

    async def _generate(self, request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """One request's responses; a failure raises RequestFailed with the status the caller gets."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if request.prompt and request.prompt_token_ids:
            raise RequestFailed(invalid, "prompt: give prompt or prompt_token_ids, not both")
        if request.top_logprobs < 0:
            raise RequestFailed(invalid, "top_logprobs: must be >= 0")
        if request.stream_interval < 0:
            raise RequestFailed(invalid, "stream_interval: must be >= 0")
        try:
            params = sampling_from_proto(request, self.default_max_new_tokens)
        except InvalidRequestError as exc:
            raise RequestFailed(invalid, str(exc)) from None
        stream = self.engine.generate(
            request.request_id or None,
            request.prompt or None,
            list(request.prompt_token_ids) or None,
            params,
            request.add_special_tokens,
            stream_interval=request.stream_interval,
        )
        try:
            async for out in stream:
                if out.error:
                    raise RequestFailed(invalid, out.error)
                yield response_from_output(out)
        except InvalidRequestError as exc:
            raise RequestFailed(invalid, str(exc)) from None
        except CapacityError as exc:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except (EngineStopped, ReplicaLost) as exc:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except EngineFailure as exc:
            raise RequestFailed(grpc.StatusCode.INTERNAL, str(exc)) from None
        finally:
            await stream.aclose()  # caller gone or error: abort the request in the engine

    async def GetStats(
        self, request: worker_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        # the engine thread computes them between steps; while a long step runs (a prefill chunk of a very long
        # prompt) the last ones answer, so a router's poll never times out on a busy worker
        after = (request.cache_epoch, request.cache_seq) if request.cache_events else None
        future = asyncio.wrap_future(self.engine.stats(after))
        try:
            st = await asyncio.wait_for(asyncio.shield(future), STATS_WAIT_S)
        except TimeoutError:
            future.cancel()
            if not self._stats:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no stats yet: the engine is busy")
            st = self._stats[-1]  # without cache events: they were someone else's sequel; asked again next poll
        except ReplicaFailure as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self._stats[:] = [dataclasses.replace(st, cache=None)]
        return worker_pb2.WorkerStats(
            kv_usage=st.kv.usage,
            kv_fragmentation=st.kv.fragmentation,
            kv_blocks_total=st.kv.total_blocks,
            kv_blocks_free=st.kv.free_blocks,
            kv_block_size=st.block_size,
            attention_entropy_drift=st.attention_entropy_drift,
            token_latency_jitter_ms=st.token_latency_jitter_ms,
            num_running=st.num_running,
            num_waiting=st.num_waiting,
            weight_version=st.weight_version,
            prefix_cache_hit_rate=st.kv.prefix_hit_rate,
            layers=[
                worker_pb2.LayerSparsity(layer=i, attention_entropy=h, attention_entropy_drift=d, topk=k)
                for i, h, d, k in st.layers
            ],
            generated_tokens_total=st.generated_tokens_total,
            preemptions_total=st.num_preemptions,
            speculative=_speculative(st.speculative),
            cache_events=_cache_events(st.cache, st.block_size),
            mean_token_latency_ms=st.mean_token_latency_ms,
            draining=self.engine.draining,
            world_size=len(st.ranks),
            ranks=[
                worker_pb2.RankMemory(
                    rank=m.rank,
                    weight_bytes=m.weight_bytes,
                    kv_bytes=m.kv_bytes,
                    device_bytes=m.device_bytes,
                    host_rss_bytes=m.host_rss_bytes,
                    weight_bytes_by_dtype=m.weight_bytes_by_dtype,
                )
                for m in st.ranks
            ],
        )

    async def GetModelInfo(
        self, request: worker_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ModelInfo:
        i = self.engine.info
        return worker_pb2.ModelInfo(
            served_model_name=i.served_model_name,
            architecture="GlmMoeDsaForCausalLM",
            max_model_len=i.max_model_len,
            vocab_size=i.vocab_size,
            eos_token_ids=i.eos_token_ids,
            dtype=i.dtype,
            device=i.device,
            weight_version=i.weight_version,
            tokenizer_fingerprint=i.tokenizer_fingerprint,
            tensor_parallel_size=i.tensor_parallel_size,
            expert_parallel=i.expert_parallel,
        )

    async def Tokenize(
        self, request: worker_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TokenizeResponse:
        tok, limit = self.engine.tokenizer, self.engine.info.max_model_len
        try:
            # off the event loop: a long text takes a while even when it is refused after its first pieces
            ids = await asyncio.to_thread(tok.encode_bounded, request.text, limit, request.add_special_tokens, "text")
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.TokenizeResponse(token_ids=ids)

    async def UpdateWeights(
        self, request: worker_pb2.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.UpdateWeightsResponse:
        try:
            location = str(weights_location(request.location, self.weights_root))
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return await self._update(request.version, location, context)

    async def PushWeights(
        self, request_iterator: AsyncIterator[worker_pb2.PushWeightsChunk], context: grpc.aio.ServicerContext
    ) -> worker_pb2.UpdateWeightsResponse:
        if self.weights_root is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "this worker takes no weight updates: start it with --weights-root")  # fmt: skip
        assert self.weights_root is not None
        try:
            version, staged = await receive_push(
                request_iterator, self.weights_root, self.max_push_bytes, self._check_newer,
                lambda: context.send_initial_metadata(((STREAM_ACCEPTED_KEY, "1"),)),
            )  # fmt: skip
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except _NotNewer as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        try:
            return await self._update(version, str(staged), context, on_this_host=True)
        finally:  # the weights are in memory now (or refused): the staged copy is not needed
            await asyncio.to_thread(shutil.rmtree, staged, True)

    async def SyncWeights(
        self, request: worker_pb2.SyncWeightsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.UpdateWeightsResponse:
        if self.weights_root is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "this worker takes no weight updates: start it with --weights-root")  # fmt: skip
        try:
            spec = self.sync_spec(request)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return await self._update(request.version, spec, context)

    def sync_spec(self, request: worker_pb2.SyncWeightsRequest) -> SyncSpec:
        info = self.engine.info
        try:
            split_address(request.rendezvous)
        except ValueError as exc:
            raise InvalidRequestError("rendezvous", str(exc)) from None
        if not GROUP_NAME.match(request.group):
            raise InvalidRequestError("group", "1-160 letters, digits, '.', '_', '/' or '-'")
        senders = request.senders or 1
        if not 0 < senders <= MAX_SENDERS:
            raise InvalidRequestError("senders", f"must be in [1, {MAX_SENDERS}]")
        ranks = info.tensor_parallel_size
        if request.world_size != senders + ranks:
            raise InvalidRequestError("world_size", f"must be senders ({senders}) + this replica's {ranks} ranks")
        timeout = request.timeout_seconds or info.collective_timeout_s
        if not 0 < timeout <= 3600:
            raise InvalidRequestError("timeout_seconds", "must be in (0, 3600]")
        return SyncSpec(request.version, request.rendezvous, request.group, request.world_size, timeout,
                        self.max_push_bytes, request.tokenizer_fingerprint, senders)  # fmt: skip

    @functools.cached_property
    def max_push_bytes(self) -> int:
        """What one push may declare: a few times the served weights (a float32 checkpoint of bf16 weights is
        twice their size), plus room for the config and tokenizer files."""
        return self.engine.info.max_update_bytes

    def _check_newer(self, version: int) -> None:
        served = self.engine.info.weight_version
        if version <= served:
            raise _NotNewer(f"version: must be greater than the served {served}, got {version}")

    async def _update(
        self, version: int, source: WeightSource, context: grpc.aio.ServicerContext, on_this_host: bool = False
    ) -> worker_pb2.UpdateWeightsResponse:
        """`on_this_host`: the folder is on this pod only (a push), so the replica's other pods get their parts
        from this one."""
        async with self._weights_lock:  # one update at a time; versions stay ordered
            try:
                self._check_newer(version)
            except _NotNewer as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            try:
                load_s, swap_s = await self.engine.update_weights(source, version, on_this_host)
            except InvalidRequestError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except (CheckpointError, ConfigError) as exc:
                where = "location" if isinstance(source, str) else "sync"
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {exc}")
            except ReplicaFailure as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        where = source if isinstance(source, str) else f"the trainer's group {source.group}"
        log.info("weights v%d from %s: read %.2fs, swap %.3fs", version, where, load_s, swap_s)
        return worker_pb2.UpdateWeightsResponse(version=version, load_seconds=load_s, swap_seconds=swap_s)

    async def GetTokenizer(
        self, request: worker_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TokenizerFiles:
        tok = self.engine.tokenizer
        tokenizer_json, config_json = tok.files
        return worker_pb2.TokenizerFiles(
            tokenizer_json=tokenizer_json, tokenizer_config_json=config_json, fingerprint=tok.fingerprint
        )

    async def Detokenize(
        self, request: worker_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DetokenizeResponse:
        try:
            check_vocabulary("token_ids", request.token_ids, self.engine.tokenizer.vocab_size)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        text = self.engine.tokenizer.decode(list(request.token_ids), request.skip_special_tokens)
        return worker_pb2.DetokenizeResponse(text=text)


def _cache_events(delta: CacheDelta | None, block_size: int) -> worker_pb2.CacheEvents | None:
    if delta is None:
        return None
    return worker_pb2.CacheEvents(epoch=delta.epoch, after=delta.after, seq=delta.seq, snapshot=delta.snapshot,
                                  stored=delta.stored, removed=delta.removed, block_size=block_size)  # fmt: skip


def _speculative(spec: SpecCounters | None) -> worker_pb2.SpeculativeStats | None:
    if spec is None:
        return None
    return worker_pb2.SpeculativeStats(
        method=spec.method,
        num_speculative_tokens=spec.k,
        drafts_total=spec.steps,
        draft_tokens_total=spec.drafted,
        accepted_tokens_total=spec.accepted,
        accepted_tokens_by_position=spec.by_position,
    )
