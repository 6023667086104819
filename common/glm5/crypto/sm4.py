"""SM4-GCM payload envelopes (GB/T 32907-2016 block cipher, GCM as in RFC 8998).

A sealed message is `Envelope{key_id, nonce, ciphertext || tag, sequence}`: a fresh random 96-bit nonce per
message, a 16-byte tag, and associated data binding it to its request id and sequence number, so a chunk
cannot be moved to another request or replayed within its stream. Keys carry ids so they can rotate: a ring
holds every key still accepted and names the one that seals. ECB is never used (no IV, leaks patterns).
"""

from __future__ import annotations

import base64
import binascii
import os
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from glm5.errors import ConfigError, Glm5Error

KEY_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
ACTIVE_FILE = "active"  # in a key directory: the id of the key that seals


class EnvelopeError(Glm5Error, ValueError):
    """An envelope cannot be opened: unknown key, wrong key, tampered, replayed or malformed."""


@dataclass(frozen=True, slots=True)
class Sealed:
    key_id: str
    nonce: bytes
    ciphertext: bytes  # ciphertext || tag
    sequence: int = 0
    issued_at_ms: int = 0  # authenticated: a replay window can trust it


def associated_data(request_id: str, sequence: int, issued_at_ms: int = 0) -> bytes:
    return (request_id.encode() + b"\0" + sequence.to_bytes(8, "big")
            + issued_at_ms.to_bytes(8, "big", signed=True))  # fmt: skip


class KeyRing:
    def __init__(self, keys: dict[str, bytes], active: str | None = None) -> None:
        if not keys:
            raise ConfigError("an SM4 key ring needs at least one key")
        for key_id, key in keys.items():
            if len(key) != KEY_BYTES:
                raise ConfigError(f"SM4 key {key_id!r} must be {KEY_BYTES} bytes, got {len(key)}")
        active = active or sorted(keys)[-1]
        if active not in keys:
            raise ConfigError(f"the active SM4 key {active!r} is not in the ring ({sorted(keys)})")
        self.keys = dict(keys)
        self.active = active

    @classmethod
    def from_dir(cls, path: str | Path) -> KeyRing:
        """One file per key, named by its id, holding 16 bytes as hex, base64 or raw (a mounted Kubernetes
        Secret looks like this); an optional `active` file names the sealing key (default: the last id)."""
        path = Path(path)
        if not path.is_dir():
            raise ConfigError(f"SM4 key directory {path} does not exist")
        keys: dict[str, bytes] = {}
        active = None
        for f in sorted(path.iterdir()):
            if f.name.startswith(".") or not f.is_file():
                continue  # the ..data symlinks of a mounted Secret
            if f.name == ACTIVE_FILE:
                active = f.read_text().strip()
                continue
            keys[f.name] = _decode_key(f.name, f.read_bytes())
        return cls(keys, active)

    def seal(self, plaintext: bytes, request_id: str, sequence: int = 0, issued_at_ms: int | None = None) -> Sealed:
        nonce = os.urandom(NONCE_BYTES)
        issued = int(time.time() * 1000) if issued_at_ms is None else issued_at_ms
        enc = Cipher(algorithms.SM4(self.keys[self.active]), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(associated_data(request_id, sequence, issued))
        body = enc.update(plaintext) + enc.finalize()
        return Sealed(self.active, nonce, body + enc.tag, sequence, issued)

    def open(self, sealed: Sealed, request_id: str) -> bytes:
        key = self.keys.get(sealed.key_id)
        if key is None:
            raise EnvelopeError(f"unknown key id {sealed.key_id!r}")
        if len(sealed.nonce) != NONCE_BYTES:
            raise EnvelopeError(f"nonce must be {NONCE_BYTES} bytes, got {len(sealed.nonce)}")
        if len(sealed.ciphertext) < TAG_BYTES:
            raise EnvelopeError("ciphertext is shorter than the GCM tag")
        body, tag = sealed.ciphertext[:-TAG_BYTES], sealed.ciphertext[-TAG_BYTES:]
        dec = Cipher(algorithms.SM4(key), modes.GCM(sealed.nonce, tag)).decryptor()
        dec.authenticate_additional_data(associated_data(request_id, sealed.sequence, sealed.issued_at_ms))
        try:
            return dec.update(body) + dec.finalize()
        except InvalidTag:
            raise EnvelopeError("authentication failed: wrong key, tampered data or wrong request") from None


class ReplayGuard:
    """Refuses a sealed request older than `window_s`, from the future by more than `skew_s`, or whose request id
    was already accepted within the window. Memory is bounded: when `max_entries` ids are remembered the oldest
    go, and from then on requests issued before the newest forgotten one are refused as too old."""

    def __init__(self, window_s: float = 300.0, max_entries: int = 200_000, skew_s: float = 30.0) -> None:
        self.window_ms, self.skew_ms, self.max_entries = int(window_s * 1000), int(skew_s * 1000), max_entries
        self.seen: dict[tuple[str, str], int] = {}  # (key id, request id) -> issued_at_ms, in insertion order
        self.floor_ms = 0

    def check(self, sealed: Sealed, request_id: str, now_ms: int | None = None) -> None:
        """Call after the envelope opened (its issued_at_ms is authentic); raises EnvelopeError on a replay."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        issued = sealed.issued_at_ms
        if issued < now - self.window_ms or issued < self.floor_ms:
            raise EnvelopeError(f"the sealed request is older than the {self.window_ms // 1000} s replay window "
                                "(or was sealed without a time): seal it again")  # fmt: skip
        if issued > now + self.skew_ms:
            raise EnvelopeError("the sealed request is dated in the future: check the client's clock")
        self._expire(now)
        key = (sealed.key_id, request_id)
        if key in self.seen:
            raise EnvelopeError(f"request id {request_id!r} was already served: a replayed envelope is refused")
        self.seen[key] = issued
        while len(self.seen) > self.max_entries:
            oldest = next(iter(self.seen))
            self.floor_ms = max(self.floor_ms, self.seen.pop(oldest) + 1)

    def _expire(self, now: int) -> None:
        # insertion order is close to issue order; stop at the first entry still inside the window
        for key, issued in list(self.seen.items()):
            if issued >= now - self.window_ms:
                break
            del self.seen[key]


class StreamOpener:
    """Opens the chunks of one sealed stream in order: sequence numbers must increase by one from 1, so a
    replayed, dropped or reordered chunk is rejected."""

    def __init__(self, ring: KeyRing, request_id: str) -> None:
        self.ring = ring
        self.request_id = request_id
        self.next_sequence = 1

    def open(self, sealed: Sealed) -> bytes:
        if sealed.sequence != self.next_sequence:
            raise EnvelopeError(f"chunk sequence {sealed.sequence}, expected {self.next_sequence} (replayed or lost)")
        plaintext = self.ring.open(sealed, self.request_id)
        self.next_sequence += 1
        return plaintext


def _decode_key(key_id: str, raw: bytes) -> bytes:
    if len(raw) == KEY_BYTES:
        return raw
    text = raw.strip()
    for decode in (binascii.unhexlify, base64.b64decode):
        try:
            key = decode(text)
        except (ValueError, binascii.Error):
            continue
        if len(key) == KEY_BYTES:
            return key
    raise ConfigError(f"SM4 key {key_id!r}: expected {KEY_BYTES} bytes (raw, 32 hex digits or base64)")
