"""SM4-GCM envelopes: standard vectors, tamper/wrong-key/replay rejection, key files."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from glm5.crypto.envelopes import (
    OUTER_FIELDS,
    SEALED_ERROR_KEY,
    StreamSealer,
    from_proto,
    open_error,
    open_message,
    open_stream_message,
    seal_message,
    seal_request,
)
from glm5.crypto.sm4 import EnvelopeError, KeyRing, ReplayGuard, Sealed, StreamOpener
from glm5.errors import ConfigError
from glm5.v1 import router_pb2, worker_pb2

KEY = bytes.fromhex("0123456789abcdeffedcba9876543210")


def test_gbt_32907_2016_block_vector() -> None:
    # One block with a zero IV in CBC is the raw block cipher (the standard's example); no ECB.
    enc = Cipher(algorithms.SM4(KEY), modes.CBC(bytes(16))).encryptor()
    assert (enc.update(KEY) + enc.finalize()).hex() == "681edf34d206965e86b3e94f536e4246"


def test_rfc_8998_sm4_gcm_vector() -> None:
    iv = bytes.fromhex("00001234567800000000ABCD")
    plaintext = bytes.fromhex(
        "AAAAAAAAAAAAAAAABBBBBBBBBBBBBBBBCCCCCCCCCCCCCCCCDDDDDDDDDDDDDDDD"
        "EEEEEEEEEEEEEEEEFFFFFFFFFFFFFFFFEEEEEEEEEEEEEEEEAAAAAAAAAAAAAAAA"
    )
    aad = bytes.fromhex("FEEDFACEDEADBEEFFEEDFACEDEADBEEFABADDAD2")
    enc = Cipher(algorithms.SM4(KEY), modes.GCM(iv)).encryptor()
    enc.authenticate_additional_data(aad)
    ciphertext = enc.update(plaintext) + enc.finalize()
    assert ciphertext.hex().upper() == (
        "17F399F08C67D5EE19D0DC9969C4BB7D5FD46FD3756489069157B282BB200735"
        "D82710CA5C22F0CCFA7CBF93D496AC15A56834CBCF98C397B4024A2691233B8D"
    )
    assert enc.tag.hex().upper() == "83DE3541E4C2B58177E065A9BF7B62EC"


def test_round_trip_with_fresh_nonces() -> None:
    ring = KeyRing({"k1": KEY})
    a, b = ring.seal(b"hello", "req-1"), ring.seal(b"hello", "req-1")
    assert a.nonce != b.nonce and a.ciphertext != b.ciphertext  # no deterministic ciphertexts
    assert ring.open(a, "req-1") == b"hello"


def test_tampered_wrong_key_wrong_request_and_unknown_key_are_rejected() -> None:
    ring = KeyRing({"k1": KEY})
    sealed = ring.seal(b"prompt", "req-1")
    flipped = bytes([sealed.ciphertext[0] ^ 1]) + sealed.ciphertext[1:]
    with pytest.raises(EnvelopeError, match="authentication failed"):
        ring.open(Sealed(sealed.key_id, sealed.nonce, flipped), "req-1")
    with pytest.raises(EnvelopeError, match="authentication failed"):
        KeyRing({"k1": bytes(16)}).open(sealed, "req-1")
    with pytest.raises(EnvelopeError, match="authentication failed"):
        ring.open(sealed, "req-2")  # bound to its request id
    with pytest.raises(EnvelopeError, match="unknown key id"):
        ring.open(Sealed("k9", sealed.nonce, sealed.ciphertext), "req-1")
    with pytest.raises(EnvelopeError, match="nonce"):
        ring.open(Sealed("k1", b"short", sealed.ciphertext), "req-1")


def test_stream_chunks_reject_replay_and_reorder() -> None:
    ring = KeyRing({"k1": KEY})
    chunks = [ring.seal(f"chunk {i}".encode(), "req-1", sequence=i, purpose="response") for i in (1, 2, 3)]
    opener = StreamOpener(ring, "req-1")
    assert opener.open(chunks[0]) == b"chunk 1"
    with pytest.raises(EnvelopeError, match="replayed or lost"):
        opener.open(chunks[0])  # replay
    with pytest.raises(EnvelopeError, match="replayed or lost"):
        opener.open(chunks[2])  # skipped one
    assert opener.open(chunks[1]) == b"chunk 2"
    issued = chunks[2].issued_at_ms
    redated = Sealed("k1", chunks[2].nonce, chunks[2].ciphertext, sequence=3, issued_at_ms=issued + 1)
    with pytest.raises(EnvelopeError, match="authentication failed"):  # the time is authenticated too
        opener.open(redated)
    forged = Sealed("k1", chunks[2].nonce, chunks[2].ciphertext, sequence=3, issued_at_ms=issued)
    assert opener.open(forged) == b"chunk 3"
    moved = Sealed("k1", chunks[2].nonce, chunks[2].ciphertext, sequence=4, issued_at_ms=issued)  # authenticated
    with pytest.raises(EnvelopeError, match="authentication failed"):
        opener.open(moved)


class Clock:
    """The guard's injectable clock: seconds, moved by hand."""

    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


T0_MS = 1_000_000_000_000  # the tests' "now", Unix milliseconds


def _seal(ring: KeyRing, request_id: str, offset_s: float) -> Sealed:
    return ring.seal(b"x", request_id, issued_at_ms=T0_MS + int(offset_s * 1000))


def test_replay_guard_refuses_repeats_stale_and_future_requests() -> None:
    ring, clock = KeyRing({"k1": KEY}), Clock(T0_MS / 1000)
    guard = ReplayGuard(window_s=60, max_entries=3, clock=clock)
    first = _seal(ring, "req-1", 0)
    clock.now_s += 0.01
    guard.check(first, "req-1")
    with pytest.raises(EnvelopeError, match="already served"):
        guard.check(first, "req-1")
    guard.check(_seal(ring, "req-2", 0), "req-2")  # another id is fine
    with pytest.raises(EnvelopeError, match="older than"):
        guard.check(_seal(ring, "req-3", -61), "req-3")
    with pytest.raises(EnvelopeError, match="future"):
        guard.check(_seal(ring, "req-4", 31), "req-4")
    # past its window an id is forgotten (the envelope itself is then too old to be accepted)
    clock.now_s = T0_MS / 1000 + 61
    guard.check(_seal(ring, "req-1", 61), "req-1")
    assert len(guard) == 1
    # memory is bounded: once ids are evicted early, envelopes issued before them count as too old
    clock.now_s += 1
    for i in range(5):
        guard.check(_seal(ring, f"fill-{i}", 62 + i / 1000), f"fill-{i}")
    assert len(guard) == 3
    with pytest.raises(EnvelopeError, match="older than"):
        guard.check(_seal(ring, "late", 62), "late")


def test_replay_guard_bounds_clock_skew_and_expires_around_it() -> None:
    """Accepted from `window` in the past to `skew` in the future; each id remembered until its envelope is too old
    (issued + window), whatever order the ids came in: a future-dated one holds up no other's expiry."""
    ring, clock = KeyRing({"k1": KEY}), Clock(T0_MS / 1000)
    guard = ReplayGuard(window_s=60, skew_s=30, clock=clock)
    envelopes = {name: _seal(ring, name, offset) for name, offset in
                 [("future", 29.5), ("past", -59), ("now", 0), ("edge", 30)]}  # fmt: skip
    for name, env in envelopes.items():
        guard.check(env, name)
    with pytest.raises(EnvelopeError, match="future"):
        guard.check(_seal(ring, "too-far", 30.5), "too-far")
    clock.now_s = T0_MS / 1000 + 1.5  # "past" is too old now, and its id forgotten
    with pytest.raises(EnvelopeError, match="older than"):
        guard.check(envelopes["past"], "past")
    assert len(guard) == 3
    clock.now_s = T0_MS / 1000 + 60.5  # "now" expired although "future" (remembered longer) came in before it
    assert len(guard) == 2
    guard.check(_seal(ring, "now", 60.5), "now")  # a new envelope with that id is served
    clock.now_s = T0_MS / 1000 + 89  # inside "future"'s window: still a replay
    with pytest.raises(EnvelopeError, match="already served"):
        guard.check(envelopes["future"], "future")
    clock.now_s = T0_MS / 1000 + 89.6  # past it: too old, and forgotten
    with pytest.raises(EnvelopeError, match="older than"):
        guard.check(envelopes["future"], "future")
    assert len(guard) == 2  # "edge" (until +90) and the new "now"
    clock.now_s = T0_MS / 1000 + 121
    assert len(guard) == 0


def test_replay_guard_settings_are_bounded_and_a_shared_claim_outlives_acceptance() -> None:
    for bad in ({"window_s": 0}, {"skew_s": -1}, {"skew_s": 61}, {"max_entries": 0}):
        with pytest.raises(ConfigError):
            ReplayGuard(**{"window_s": 60, **bad})  # type: ignore[arg-type]
    assert ReplayGuard(window_s=10).skew_ms == 10_000 and ReplayGuard().skew_ms == 30_000  # the default
    clock = Clock(T0_MS / 1000)
    guard = ReplayGuard(window_s=60, skew_s=30, clock=clock)
    # another replica's clock may run up to the skew behind: the claim lasts past every replica's acceptance
    assert guard.hold_s(T0_MS) == 90
    assert guard.hold_s(T0_MS + 29_500) == 119.5
    assert guard.hold_s(T0_MS - 50_000) == 90


def test_rotation_and_key_directory(tmp_path: Path) -> None:
    (tmp_path / "2026-01").write_text(KEY.hex())
    (tmp_path / "2026-06").write_bytes(b"\x01" * 16)
    (tmp_path / "active").write_text("2026-06\n")
    ring = KeyRing.from_dir(tmp_path)
    assert ring.active == "2026-06"
    old = KeyRing({"2026-01": KEY}).seal(b"x", "r")
    assert ring.open(old, "r") == b"x"  # old key still accepted while it is in the ring
    assert ring.seal(b"x", "r").key_id == "2026-06"
    (tmp_path / "bad").write_text("not a key")
    with pytest.raises(ConfigError, match="'bad'"):
        KeyRing.from_dir(tmp_path)


def test_protobuf_envelopes() -> None:
    ring = KeyRing({"k1": KEY})
    req = worker_pb2.GenerateRequest(request_id="r1", prompt="secret question")
    env = seal_message(ring, req, "r1")
    assert b"secret" not in env.ciphertext
    assert open_message(ring, env, worker_pb2.GenerateRequest, "r1") == req
    opener = StreamOpener(ring, "r1")
    chunk = seal_message(ring, worker_pb2.GenerateResponse(text="answer"), "r1", sequence=1, purpose="response")
    assert open_stream_message(opener, chunk, worker_pb2.GenerateResponse).text == "answer"


def test_a_sealed_request_holds_every_routing_field() -> None:
    ring = KeyRing({"k1": KEY})
    routed = router_pb2.RouterGenerateRequest(
        request=worker_pb2.GenerateRequest(prompt="secret"), model="m", priority=router_pb2.PRIORITY_LONG,
        session_id="s", thinking=router_pb2.THINKING_MODE_DEEP, chat=True, request_id="ignored",
    )  # fmt: skip
    outer = seal_request(ring, routed, "r1")
    assert {f.name for f, _ in outer.ListFields()} == {"request_id", "sealed"} == OUTER_FIELDS
    inner = open_message(ring, outer.sealed, router_pb2.RouterGenerateRequest, "r1")
    assert inner.model == "m" and inner.chat and inner.session_id == "s" and inner.request.prompt == "secret"
    assert inner.priority == router_pb2.PRIORITY_LONG and inner.thinking == router_pb2.THINKING_MODE_DEEP
    assert not inner.request_id and not inner.HasField("sealed")


def test_purposes_do_not_mix_and_a_sealed_error_follows_the_chunks() -> None:
    """The associated data names what was sealed: a request, a response chunk and an error cannot stand in for
    one another, even with the same request id and sequence number."""
    ring = KeyRing({"k1": KEY})
    sealer = StreamSealer(ring, "r1")
    chunk = sealer.seal(router_pb2.RouterGenerateResponse(content_delta="hi"))
    trailer = (("other", "x"), (SEALED_ERROR_KEY, sealer.seal_error(3, "regex: bad pattern SECRET(((")))
    as_error = from_proto(router_pb2.Envelope.FromString(trailer[1][1]))
    with pytest.raises(EnvelopeError, match="not a sealed response"):
        StreamOpener(ring, "r1").open(Sealed("k1", as_error.nonce, as_error.ciphertext, 1, as_error.issued_at_ms))
    with pytest.raises(EnvelopeError, match="not a sealed error"):
        StreamOpener(ring, "r1").open_error(from_proto(chunk))
    with pytest.raises(EnvelopeError, match="not a sealed request"):
        ring.open(from_proto(seal_message(ring, router_pb2.RouterGenerateResponse(), "r1", purpose="response")), "r1")
    opener = StreamOpener(ring, "r1")
    with pytest.raises(EnvelopeError, match="replayed or lost"):  # the error is number 2: after the chunk
        open_error(opener, trailer)
    assert open_stream_message(opener, chunk, router_pb2.RouterGenerateResponse).content_delta == "hi"
    error = open_error(opener, trailer)
    assert error is not None and error.code == 3 and "SECRET(((" in error.message
    assert open_error(StreamOpener(ring, "r1"), (("other", "x"),)) is None  # an error sent in the clear
