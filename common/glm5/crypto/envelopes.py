"""Protobuf messages in and out of SM4-GCM envelopes (glm5.v1.Envelope): what a client sends, what the
router returns chunk by chunk, and the sealed reason of a failed request."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from glm5.crypto.sm4 import EnvelopeError, KeyRing, Purpose, ReplayGuard, Sealed, StreamOpener
from glm5.v1 import router_pb2

M = TypeVar("M", bound=Message)
SEALED_ERROR_KEY = "glm5-sealed-error-bin"  # trailing metadata: an Envelope holding a RouterError
# RouterGenerateRequest fields a sealed request may set outside its envelope: the rest go inside
OUTER_FIELDS = frozenset({"sealed", "request_id"})


def to_proto(sealed: Sealed) -> router_pb2.Envelope:
    return router_pb2.Envelope(
        key_id=sealed.key_id,
        nonce=sealed.nonce,
        ciphertext=sealed.ciphertext,
        sequence=sealed.sequence,
        issued_at_ms=sealed.issued_at_ms,
    )


def from_proto(env: router_pb2.Envelope) -> Sealed:
    return Sealed(env.key_id, bytes(env.nonce), bytes(env.ciphertext), env.sequence, env.issued_at_ms)


def seal_message(ring: KeyRing, message: Message, request_id: str, sequence: int = 0,
                 issued_at_ms: int | None = None, purpose: Purpose = "request") -> router_pb2.Envelope:  # fmt: skip
    return to_proto(ring.seal(message.SerializeToString(), request_id, sequence, issued_at_ms, purpose))


def seal_request(ring: KeyRing, request: router_pb2.RouterGenerateRequest, request_id: str,
                 issued_at_ms: int | None = None) -> router_pb2.RouterGenerateRequest:  # fmt: skip
    """What a client sends: the whole request (routing fields included) sealed, with only the request id outside."""
    inner = router_pb2.RouterGenerateRequest()
    inner.CopyFrom(request)
    inner.ClearField("sealed")
    inner.ClearField("request_id")
    return router_pb2.RouterGenerateRequest(request_id=request_id,
                                            sealed=seal_message(ring, inner, request_id, 0, issued_at_ms))  # fmt: skip


def open_message(ring: KeyRing, env: router_pb2.Envelope, cls: type[M], request_id: str,
                 guard: ReplayGuard | None = None) -> M:  # fmt: skip
    """Opens a request envelope; with a guard, a stale or already-served one raises EnvelopeError."""
    if env.sequence != 0:
        raise EnvelopeError("a request envelope must have sequence 0")
    sealed = from_proto(env)
    msg = _parse(cls, ring.open(sealed, request_id, "request"))
    if guard is not None:
        guard.check(sealed, request_id)
    return msg


def open_stream_message(opener: StreamOpener, env: router_pb2.Envelope, cls: type[M]) -> M:
    return _parse(cls, opener.open(from_proto(env)))


class StreamSealer:
    """The router's side of one sealed stream: chunks numbered 1, 2, ..., then an error (if any) numbered next."""

    def __init__(self, ring: KeyRing, request_id: str) -> None:
        self.ring, self.request_id, self.sequence = ring, request_id, 0

    def seal(self, message: Message) -> router_pb2.Envelope:
        self.sequence += 1
        return seal_message(self.ring, message, self.request_id, self.sequence, purpose="response")

    def seal_error(self, code: int, message: str) -> bytes:
        """The trailing metadata value (SEALED_ERROR_KEY) for a failure with this status code and details."""
        self.sequence += 1
        error = router_pb2.RouterError(code=code, message=message)
        env = seal_message(self.ring, error, self.request_id, self.sequence, purpose="error")
        return bytes(env.SerializeToString())


def open_error(opener: StreamOpener, trailing_metadata: Iterable[tuple[str, str | bytes]] | None
               ) -> router_pb2.RouterError | None:  # fmt: skip
    """The sealed reason in a failed call's trailing metadata (`AioRpcError.trailing_metadata()`), opened after the
    stream's chunks (its sequence number follows theirs); None when the router sent none (an envelope it could not
    open, a replay: those errors are in the status, since they hold nothing of the payload)."""
    value = next((v for k, v in trailing_metadata or () if k == SEALED_ERROR_KEY), None)
    if value is None:
        return None
    if not isinstance(value, bytes):
        raise EnvelopeError(f"{SEALED_ERROR_KEY} must be binary metadata")
    env = _parse(router_pb2.Envelope, value)
    return _parse(router_pb2.RouterError, opener.open_error(from_proto(env)))


def _parse(cls: type[M], data: bytes) -> M:
    msg: M = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError:
        # the decoder's message is left out: it may quote the bytes
        raise EnvelopeError(f"the sealed payload is not a {cls.__name__}") from None
    return msg
