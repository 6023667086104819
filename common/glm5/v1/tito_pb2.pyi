from glm5.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_STATUS_UNSPECIFIED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_COMPLETED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_TRUNCATED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_ABORTED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_FAILED: _ClassVar[RolloutStatus]
ROLLOUT_STATUS_UNSPECIFIED: RolloutStatus
ROLLOUT_STATUS_COMPLETED: RolloutStatus
ROLLOUT_STATUS_TRUNCATED: RolloutStatus
ROLLOUT_STATUS_ABORTED: RolloutStatus
ROLLOUT_STATUS_FAILED: RolloutStatus

class TurnRequest(_message.Message):
    __slots__ = ("rollout_id", "group_id", "context_token_ids", "sampling", "stream_interval")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    group_id: str
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    stream_interval: int
    def __init__(self, rollout_id: _Optional[str] = ..., group_id: _Optional[str] = ..., context_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class TurnResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "weight_version", "rank", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: int
    rank: str
    finish_reason: _common_pb2.FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[int] = ..., rank: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class FinishRolloutRequest(_message.Message):
    __slots__ = ("rollout_id", "reward", "status")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    reward: float
    status: RolloutStatus
    def __init__(self, rollout_id: _Optional[str] = ..., reward: _Optional[float] = ..., status: _Optional[_Union[RolloutStatus, str]] = ...) -> None: ...

class GetRolloutRequest(_message.Message):
    __slots__ = ("rollout_id",)
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    def __init__(self, rollout_id: _Optional[str] = ...) -> None: ...

class RolloutRecord(_message.Message):
    __slots__ = ("rollout_id", "rollout_key", "group_id", "token_ids", "loss_mask", "logprobs", "token_versions", "turn_versions", "reward", "status", "prompt_tokens")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TURN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    rollout_key: int
    group_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    turn_versions: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    status: RolloutStatus
    prompt_tokens: int
    def __init__(self, rollout_id: _Optional[str] = ..., rollout_key: _Optional[int] = ..., group_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., turn_versions: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., status: _Optional[_Union[RolloutStatus, str]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class TakeRolloutsRequest(_message.Message):
    __slots__ = ("max_records", "timeout_ms")
    MAX_RECORDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    max_records: int
    timeout_ms: int
    def __init__(self, max_records: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class TakeRolloutsResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[RolloutRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[RolloutRecord, _Mapping]]] = ...) -> None: ...

class GetRoutingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankState(_message.Message):
    __slots__ = ("address", "rollouts", "alive", "tokenizer_fingerprint", "excluded")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    address: str
    rollouts: int
    alive: bool
    tokenizer_fingerprint: str
    excluded: str
    def __init__(self, address: _Optional[str] = ..., rollouts: _Optional[int] = ..., alive: _Optional[bool] = ..., tokenizer_fingerprint: _Optional[str] = ..., excluded: _Optional[str] = ...) -> None: ...

class RoutingState(_message.Message):
    __slots__ = ("ranks", "overflow_moves", "rehomed")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_MOVES_FIELD_NUMBER: _ClassVar[int]
    REHOMED_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankState]
    overflow_moves: int
    rehomed: int
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankState, _Mapping]]] = ..., overflow_moves: _Optional[int] = ..., rehomed: _Optional[int] = ...) -> None: ...
