from glm5.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling", "return_logprobs", "top_logprobs", "return_prompt_logprobs", "add_special_tokens", "skip_special_tokens", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    return_logprobs: bool
    top_logprobs: int
    return_prompt_logprobs: bool
    add_special_tokens: bool
    skip_special_tokens: bool
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., return_prompt_logprobs: _Optional[bool] = ..., add_special_tokens: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class GenerateStreamRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateStreamRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateStreamRequest, _Mapping]]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("id", "start", "cancel")
    ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    start: GenerateRequest
    cancel: bool
    def __init__(self, id: _Optional[int] = ..., start: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class GenerateStreamResponses(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[GenerateStreamResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[GenerateStreamResponse, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("id", "response", "error_code", "error_message")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: int
    response: GenerateResponse
    error_code: int
    error_message: str
    def __init__(self, id: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "prompt_logprobs", "finish_reason", "stop_reason", "usage", "weight_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_reason: str
    usage: _common_pb2.Usage
    weight_version: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("cache_events", "cache_epoch", "cache_seq")
    CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SEQ_FIELD_NUMBER: _ClassVar[int]
    cache_events: bool
    cache_epoch: int
    cache_seq: int
    def __init__(self, cache_events: _Optional[bool] = ..., cache_epoch: _Optional[int] = ..., cache_seq: _Optional[int] = ...) -> None: ...

class CacheEvents(_message.Message):
    __slots__ = ("epoch", "after", "seq", "snapshot", "stored", "removed", "block_size")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    after: int
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    def __init__(self, epoch: _Optional[int] = ..., after: _Optional[int] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ...) -> None: ...

class LayerSparsity(_message.Message):
    __slots__ = ("layer", "attention_entropy", "attention_entropy_drift", "topk")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_ENTROPY_DRIFT_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    layer: int
    attention_entropy: float
    attention_entropy_drift: float
    topk: int
    def __init__(self, layer: _Optional[int] = ..., attention_entropy: _Optional[float] = ..., attention_entropy_drift: _Optional[float] = ..., topk: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("kv_usage", "kv_fragmentation", "kv_blocks_total", "kv_blocks_free", "kv_block_size", "attention_entropy_drift", "token_latency_jitter_ms", "num_running", "num_waiting", "weight_version", "prefix_cache_hit_rate", "layers", "generated_tokens_total", "mean_token_latency_ms", "world_size", "ranks", "preemptions_total", "speculative", "cache_events", "draining")
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_ENTROPY_DRIFT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LATENCY_JITTER_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEAN_TOKEN_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    kv_usage: float
    kv_fragmentation: float
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int
    attention_entropy_drift: float
    token_latency_jitter_ms: float
    num_running: int
    num_waiting: int
    weight_version: int
    prefix_cache_hit_rate: float
    layers: _containers.RepeatedCompositeFieldContainer[LayerSparsity]
    generated_tokens_total: int
    mean_token_latency_ms: float
    world_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankMemory]
    preemptions_total: int
    speculative: SpeculativeStats
    cache_events: CacheEvents
    draining: bool
    def __init__(self, kv_usage: _Optional[float] = ..., kv_fragmentation: _Optional[float] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., attention_entropy_drift: _Optional[float] = ..., token_latency_jitter_ms: _Optional[float] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., weight_version: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., layers: _Optional[_Iterable[_Union[LayerSparsity, _Mapping]]] = ..., generated_tokens_total: _Optional[int] = ..., mean_token_latency_ms: _Optional[float] = ..., world_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankMemory, _Mapping]]] = ..., preemptions_total: _Optional[int] = ..., speculative: _Optional[_Union[SpeculativeStats, _Mapping]] = ..., cache_events: _Optional[_Union[CacheEvents, _Mapping]] = ..., draining: _Optional[bool] = ...) -> None: ...

class SpeculativeStats(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "drafts_total", "draft_tokens_total", "accepted_tokens_total", "accepted_tokens_by_position")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_speculative_tokens: int
    drafts_total: int
    draft_tokens_total: int
    accepted_tokens_total: int
    accepted_tokens_by_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., drafts_total: _Optional[int] = ..., draft_tokens_total: _Optional[int] = ..., accepted_tokens_total: _Optional[int] = ..., accepted_tokens_by_position: _Optional[_Iterable[int]] = ...) -> None: ...

class RankMemory(_message.Message):
    __slots__ = ("rank", "weight_bytes", "kv_bytes", "device_bytes", "host_rss_bytes", "weight_bytes_by_dtype")
    class WeightBytesByDtypeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_BY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    weight_bytes: int
    kv_bytes: int
    device_bytes: int
    host_rss_bytes: int
    weight_bytes_by_dtype: _containers.ScalarMap[str, int]
    def __init__(self, rank: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., device_bytes: _Optional[int] = ..., host_rss_bytes: _Optional[int] = ..., weight_bytes_by_dtype: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("served_model_name", "architecture", "max_model_len", "vocab_size", "eos_token_ids", "dtype", "device", "weight_version", "tokenizer_fingerprint", "tensor_parallel_size", "expert_parallel")
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    served_model_name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    weight_version: int
    tokenizer_fingerprint: str
    tensor_parallel_size: int
    expert_parallel: bool
    def __init__(self, served_model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., weight_version: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., expert_parallel: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "location")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    version: int
    location: str
    def __init__(self, version: _Optional[int] = ..., location: _Optional[str] = ...) -> None: ...

class PushedFile(_message.Message):
    __slots__ = ("name", "size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class PushWeightsHeader(_message.Message):
    __slots__ = ("version", "files")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    version: int
    files: _containers.RepeatedCompositeFieldContainer[PushedFile]
    def __init__(self, version: _Optional[int] = ..., files: _Optional[_Iterable[_Union[PushedFile, _Mapping]]] = ...) -> None: ...

class PushWeightsChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushWeightsHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushWeightsHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SyncWeightsRequest(_message.Message):
    __slots__ = ("version", "rendezvous", "group", "world_size", "tokenizer_fingerprint", "timeout_seconds", "senders")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SENDERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    rendezvous: str
    group: str
    world_size: int
    tokenizer_fingerprint: str
    timeout_seconds: float
    senders: int
    def __init__(self, version: _Optional[int] = ..., rendezvous: _Optional[str] = ..., group: _Optional[str] = ..., world_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., senders: _Optional[int] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "load_seconds", "swap_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    load_seconds: float
    swap_seconds: float
    def __init__(self, version: _Optional[int] = ..., load_seconds: _Optional[float] = ..., swap_seconds: _Optional[float] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("tokenizer_json", "tokenizer_config_json", "fingerprint")
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json: bytes
    tokenizer_config_json: str
    fingerprint: str
    def __init__(self, tokenizer_json: _Optional[bytes] = ..., tokenizer_config_json: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...
