"""SM4-GCM payload envelopes (GB/T 32907-2016 block cipher, GCM as in RFC 8998).

A sealed message is `Envelope{key_id, nonce, ciphertext || tag, sequence, issued_at_ms}`: a fresh random 96-bit
nonce per message, a 16-byte tag, and associated data binding it to its purpose (request, response chunk or
error), its request id, sequence number and sealing time, so a chunk cannot be moved to another request, passed
off as an error (or the reverse), or replayed within its stream. Keys carry ids so they can rotate: a ring holds
every key still accepted and names the one that seals. ECB is never used (no IV, leaks patterns).
"""

from __future__ import annotations

import base64
import binascii
import heapq
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from glm5.errors import ConfigError, Glm5Error

KEY_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
ACTIVE_FILE = "active"  # in a key directory: the id of the key that seals
AD_LABEL = b"glm5.v1.Envelope/"  # then the purpose: what the sealed bytes are
Purpose = Literal["request", "response", "error"]
DEFAULT_SKEW_S = 30.0  # how far in the future a sealed request may be dated (or the replay window, if shorter)


class EnvelopeError(Glm5Error, ValueError):
    """An envelope cannot be opened: unknown key, wrong key, tampered, replayed or malformed."""


@dataclass(frozen=True, slots=True)
class Sealed:
    key_id: str
    nonce: bytes
    ciphertext: bytes  # ciphertext || tag
    sequence: int = 0
    issued_at_ms: int = 0  # authenticated: a replay window can trust it


def associated_data(purpose: Purpose, request_id: str, sequence: int, issued_at_ms: int = 0) -> bytes:
    # the label separates the kinds of sealed message (an error's plaintext must never parse as a chunk's); the
    # request id is length-prefixed, so no two inputs give the same bytes
    rid = request_id.encode()
    return (AD_LABEL + purpose.encode() + b"\0" + len(rid).to_bytes(4, "big") + rid + sequence.to_bytes(8, "big")
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

    def seal(self, plaintext: bytes, request_id: str, sequence: int = 0, issued_at_ms: int | None = None,
             purpose: Purpose = "request") -> Sealed:  # fmt: skip
        nonce = os.urandom(NONCE_BYTES)
        issued = int(time.time() * 1000) if issued_at_ms is None else issued_at_ms
        enc = Cipher(algorithms.SM4(self.keys[self.active]), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(associated_data(purpose, request_id, sequence, issued))
        body = enc.update(plaintext) + enc.finalize()
        return Sealed(self.active, nonce, body + enc.tag, sequence, issued)

    def open(self, sealed: Sealed, request_id: str, purpose: Purpose = "request") -> bytes:
        key = self.keys.get(sealed.key_id)
        if key is None:
            raise EnvelopeError(f"unknown key id {sealed.key_id!r}")
        if len(sealed.nonce) != NONCE_BYTES:
            raise EnvelopeError(f"nonce must be {NONCE_BYTES} bytes, got {len(sealed.nonce)}")
        if len(sealed.ciphertext) < TAG_BYTES:
            raise EnvelopeError("ciphertext is shorter than the GCM tag")
        body, tag = sealed.ciphertext[:-TAG_BYTES], sealed.ciphertext[-TAG_BYTES:]
        dec = Cipher(algorithms.SM4(key), modes.GCM(sealed.nonce, tag)).decryptor()
        dec.authenticate_additional_data(associated_data(purpose, request_id, sealed.sequence, sealed.issued_at_ms))
        try:
            return dec.update(body) + dec.finalize()
        except InvalidTag:
            raise EnvelopeError(
                f"authentication failed: wrong key, tampered data, wrong request or not a sealed {purpose}"
            ) from None


class ReplayGuard:
    """Refuses a sealed request issued more than `window_s` ago, more than `skew_s` in the future (the clock
    difference tolerated between a client and this router: 30 s by default, at most the window), or whose
    (key id, request id) was already accepted while its envelope is still acceptable.

    An accepted id is remembered until its envelope turns too old, issued + window: the same test that refuses a
    stale envelope then makes remembering it pointless. For a future-dated envelope that is beyond now + window;
    entries sit in a heap by issue time, so one dated in the future holds up no other's expiry (arrival order
    is not issue order). Memory is bounded: past `max_entries` the earliest-issued id goes, and from then on
    requests issued at or before it are refused as too old."""

    def __init__(self, window_s: float = 300.0, max_entries: int = 200_000, skew_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        if window_s <= 0:
            raise ConfigError(f"the replay window must be > 0 seconds, got {window_s}")
        skew_s = min(DEFAULT_SKEW_S, window_s) if skew_s is None else skew_s
        if not 0 <= skew_s <= window_s:
            # a larger skew would accept envelopes further ahead than behind, and remember each for longer
            raise ConfigError(f"the clock skew must be between 0 and the replay window ({window_s} s), got {skew_s}")
        if max_entries < 1:
            raise ConfigError(f"the replay guard needs room for at least one id, got {max_entries}")
        self.window_ms, self.skew_ms, self.max_entries = int(window_s * 1000), int(skew_s * 1000), max_entries
        self.clock = clock
        self._seen: set[tuple[str, str]] = set()  # (key id, request id)
        self._by_issue: list[tuple[int, tuple[str, str]]] = []  # heap of (issued_at_ms, id): what expires first
        self.floor_ms = 0

    def __len__(self) -> int:
        """Ids remembered now (after expiring the stale ones)."""
        self._expire(self._now_ms())
        return len(self._seen)

    def check(self, sealed: Sealed, request_id: str) -> None:
        """Call after the envelope opened (its issued_at_ms is authentic); raises EnvelopeError on a replay."""
        now = self._now_ms()
        issued = sealed.issued_at_ms
        if issued < now - self.window_ms or issued < self.floor_ms:
            raise EnvelopeError(f"the sealed request is older than the {self.window_ms / 1000:g} s replay window "
                                "(or was sealed without a time): seal it again")  # fmt: skip
        if issued > now + self.skew_ms:
            raise EnvelopeError(f"the sealed request is dated more than {self.skew_ms / 1000:g} s in the future: "
                                "check the client's clock")  # fmt: skip
        self._expire(now)
        key = (sealed.key_id, request_id)
        if key in self._seen:
            raise EnvelopeError(f"request id {request_id!r} was already served: a replayed envelope is refused")
        self._seen.add(key)
        heapq.heappush(self._by_issue, (issued, key))
        while len(self._seen) > self.max_entries:
            oldest, gone = heapq.heappop(self._by_issue)
            self._seen.discard(gone)
            self.floor_ms = max(self.floor_ms, oldest + 1)

    def hold_s(self, issued_at_ms: int) -> float:
        """How long a store shared by router replicas must keep this envelope's claim: until no replica accepts
        it, where a replica's clock may run up to the skew behind this one's (max(issued, now) + window + skew)."""
        now = self._now_ms()
        return (max(issued_at_ms, now) + self.window_ms + self.skew_ms - now) / 1000

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _expire(self, now: int) -> None:
        while self._by_issue and self._by_issue[0][0] < now - self.window_ms:
            self._seen.discard(heapq.heappop(self._by_issue)[1])


class StreamOpener:
    """Opens the chunks of one sealed stream in order: sequence numbers must increase by one from 1, so a
    replayed, dropped or reordered chunk is rejected. A sealed error takes the next number: it opens only after
    every chunk before it did."""

    def __init__(self, ring: KeyRing, request_id: str) -> None:
        self.ring = ring
        self.request_id = request_id
        self.next_sequence = 1

    def open(self, sealed: Sealed) -> bytes:
        return self._open(sealed, "response")

    def open_error(self, sealed: Sealed) -> bytes:
        return self._open(sealed, "error")

    def _open(self, sealed: Sealed, purpose: Purpose) -> bytes:
        if sealed.sequence != self.next_sequence:
            raise EnvelopeError(f"chunk sequence {sealed.sequence}, expected {self.next_sequence} (replayed or lost)")
        plaintext = self.ring.open(sealed, self.request_id, purpose)
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
