from glm5.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_SHORT: _ClassVar[Priority]
    PRIORITY_LONG: _ClassVar[Priority]

class ThinkingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    THINKING_MODE_UNSPECIFIED: _ClassVar[ThinkingMode]
    THINKING_MODE_OFF: _ClassVar[ThinkingMode]
    THINKING_MODE_LIGHT: _ClassVar[ThinkingMode]
    THINKING_MODE_DEEP: _ClassVar[ThinkingMode]
PRIORITY_UNSPECIFIED: Priority
PRIORITY_SHORT: Priority
PRIORITY_LONG: Priority
THINKING_MODE_UNSPECIFIED: ThinkingMode
THINKING_MODE_OFF: ThinkingMode
THINKING_MODE_LIGHT: ThinkingMode
THINKING_MODE_DEEP: ThinkingMode

class Envelope(_message.Message):
    __slots__ = ("key_id", "nonce", "ciphertext", "sequence", "issued_at_ms")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    nonce: bytes
    ciphertext: bytes
    sequence: int
    issued_at_ms: int
    def __init__(self, key_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., ciphertext: _Optional[bytes] = ..., sequence: _Optional[int] = ..., issued_at_ms: _Optional[int] = ...) -> None: ...

class RouterGenerateRequest(_message.Message):
    __slots__ = ("request", "sealed", "model", "priority", "session_id", "thinking", "chat", "request_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    THINKING_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request: _worker_pb2.GenerateRequest
    sealed: Envelope
    model: str
    priority: Priority
    session_id: str
    thinking: ThinkingMode
    chat: bool
    request_id: str
    def __init__(self, request: _Optional[_Union[_worker_pb2.GenerateRequest, _Mapping]] = ..., sealed: _Optional[_Union[Envelope, _Mapping]] = ..., model: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., session_id: _Optional[str] = ..., thinking: _Optional[_Union[ThinkingMode, str]] = ..., chat: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class RouterGenerateResponse(_message.Message):
    __slots__ = ("response", "sealed", "reasoning_delta", "content_delta", "worker")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    REASONING_DELTA_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DELTA_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    response: _worker_pb2.GenerateResponse
    sealed: Envelope
    reasoning_delta: str
    content_delta: str
    worker: str
    def __init__(self, response: _Optional[_Union[_worker_pb2.GenerateResponse, _Mapping]] = ..., sealed: _Optional[_Union[Envelope, _Mapping]] = ..., reasoning_delta: _Optional[str] = ..., content_delta: _Optional[str] = ..., worker: _Optional[str] = ...) -> None: ...

class RouterError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_worker_pb2.ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[_worker_pb2.ModelInfo, _Mapping]]] = ...) -> None: ...
