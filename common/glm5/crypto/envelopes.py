"""Protobuf messages in and out of SM4-GCM envelopes (glm5.v1.Envelope): what a client sends, what the
router returns chunk by chunk."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from glm5.crypto.sm4 import EnvelopeError, KeyRing, ReplayGuard, Sealed, StreamOpener
from glm5.v1 import router_pb2

M = TypeVar("M", bound=Message)


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
                 issued_at_ms: int | None = None) -> router_pb2.Envelope:  # fmt: skip
    return to_proto(ring.seal(message.SerializeToString(), request_id, sequence, issued_at_ms))


def open_message(ring: KeyRing, env: router_pb2.Envelope, cls: type[M], request_id: str,
                 guard: ReplayGuard | None = None) -> M:  # fmt: skip
    """Opens a request envelope; with a guard, a stale or already-served one raises EnvelopeError."""
    if env.sequence != 0:
        raise EnvelopeError("a request envelope must have sequence 0")
    sealed = from_proto(env)
    msg = _parse(cls, ring.open(sealed, request_id))
    if guard is not None:
        guard.check(sealed, request_id)
    return msg


def open_stream_message(opener: StreamOpener, env: router_pb2.Envelope, cls: type[M]) -> M:
    return _parse(cls, opener.open(from_proto(env)))


def _parse(cls: type[M], data: bytes) -> M:
    msg: M = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise EnvelopeError(f"the sealed payload is not a {cls.__name__}: {exc}") from exc
    return msg
