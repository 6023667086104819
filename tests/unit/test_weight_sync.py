"""glm5.weight_sync's wire format: what a receiver accepts from a peer, and how buckets are laid out."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from glm5.errors import CheckpointError
from glm5.weight_sync import (
    DTYPES,
    NAMES,
    Manifest,
    Need,
    Received,
    Receiver,
    Sender,
    TensorSpec,
    decode_needs,
    encode_needs,
    join_group,
    plan_buckets,
    segments,
    send,
    split_address,
)


def _specs() -> list[TensorSpec]:
    return [TensorSpec("a", (3, 5), "BF16"), TensorSpec("b", (7,), "F32"), TensorSpec("c", (1, 3), "F16"),
            TensorSpec("d", (1000,), "F32")]  # fmt: skip


def test_manifest_round_trip_and_buckets() -> None:
    buckets = plan_buckets(_specs(), bucket_bytes=60)
    assert [[t.name for t in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]  # d (4000 B) travels alone
    m = Manifest(3, buckets)
    assert Manifest.from_bytes(m.to_bytes()) == m
    assert m.nbytes == 30 + 28 + 6 + 4000 and m.dtypes()["c"] == "F16"
    split = Manifest(3, ((TensorSpec("a", (3, 5), "BF16", ((0, 2), (1, 1))), TensorSpec("b", (7,), "F32", ((1, 7),))),),
                     senders=2)  # fmt: skip
    assert Manifest.from_bytes(split.to_bytes()) == split and split.buckets[0][0].pieces == ((0, 20), (1, 10))


def test_each_senders_segment_holds_its_rows_in_order() -> None:
    bucket = [TensorSpec("a", (3, 5), "BF16", ((0, 2), (1, 1))), TensorSpec("b", (7,), "F32", ((1, 7),)),
              TensorSpec("c", (4, 3), "F16", ((0, 1), (1, 3)))]  # fmt: skip
    places, sizes = segments(bucket, 2)
    assert places == [[(0, 0, 20), (1, 0, 10)], [(1, 16, 28)], [(0, 24, 6), (1, 48, 18)]]
    assert sizes == [32, 72]  # each piece starts 8-byte aligned


def test_every_tensor_is_an_aligned_view_whatever_came_before() -> None:
    bucket = _specs()
    places, (size,) = segments(bucket, 1)
    offsets = [where[0][1] for where in places]
    assert all(o % 8 == 0 for o in offsets) and size >= sum(t.nbytes for t in bucket)
    flat = torch.zeros(size, dtype=torch.uint8)
    values = [torch.randn(t.shape).to(DTYPES[t.dtype]) for t in bucket]
    for v, t, at in zip(values, bucket, offsets, strict=True):
        flat[at : at + t.nbytes] = v.reshape(-1).view(torch.uint8)
    for v, t, at in zip(values, bucket, offsets, strict=True):
        got = Received(flat[at : at + t.nbytes].view(DTYPES[t.dtype]).reshape(t.shape))
        assert torch.equal(got.read(), v) and got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.read((slice(0, 1),)), v[:1])


@pytest.mark.parametrize(
    ("buckets", "message"),
    [
        ([[["w", [2], "F64"]]], "dtype"),  # only the formats weights are served or stored in travel
        ([[["w", [2], "Q9"]]], "dtype"),
        ([[["w", [2], "F32"], ["w", [2], "F32"]]], "repeated"),
        ([[["../w", [2], "F32"]]], "bad"),
        ([[["w", [-1], "F32"]]], "shape"),
        ([[["w", [1 << 20, 1 << 12], "F32"]]], "limit"),  # 16 GiB in one bucket: refused before any allocation
        ("nope", "malformed"),
        ([[["w", [3], "F32", [[0, 2]]]]], "parts"),  # rows that do not add up
        ([[["w", [3], "F32", [[0, 1], [2, 2]]]]], "parts"),  # a sender the group does not have
        ([[["w", [3], "F32", [[0, 3], [1, 0]]]]], "parts"),  # an empty part
    ],
)
def test_a_peers_manifest_is_checked(buckets: object, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        Manifest.from_bytes(json.dumps({"version": 1, "senders": 2, "buckets": buckets}).encode())
    with pytest.raises(CheckpointError, match="malformed"):
        Manifest.from_bytes(b"\x80not json")


def test_a_forwarded_checkpoints_stored_dtypes_are_checked() -> None:
    spec = TensorSpec("w", (4, 2), "F8_E4M3")
    stored = {"w": "F8_E4M3", "w_scale_inv": "F32", "x": "BF16"}
    m = Manifest(1, ((spec,),), stored=stored, quant={"quant_method": "fp8"})
    back = Manifest.from_bytes(m.to_bytes())
    assert back == m and back.dtypes() == m.stored and spec.nbytes == 8
    for stored, message in (({"x": "F32"}, "missing"), ({"w": "F8_E4M3", "../x": "F32"}, "bad"),
                            ({"w": "F8_E4M3", "x": "Q9"}, "bad")):  # fmt: skip
        with pytest.raises(CheckpointError, match=message):
            Manifest.from_bytes(Manifest(1, ((spec,),), stored=stored).to_bytes())
    raw = json.loads(m.to_bytes())
    raw["quant"] = [1]
    with pytest.raises(CheckpointError, match="malformed"):
        Manifest.from_bytes(json.dumps(raw).encode())


def test_what_an_engine_rank_asks_for_is_checked_and_cut_by_sender() -> None:
    w = TensorSpec("w", (5, 4), "F32", ((0, 3), (1, 2)))  # rows 0-2 on sender 0, 3-4 on sender 1
    m = Manifest(1, ((w, TensorSpec("b", (3,), "BF16")),), senders=2)
    # rows 2-4, columns 1-2: one row from sender 0, two from sender 1, 2 columns of 4 bytes each
    assert w.cut(((2, 5), (1, 3))) == [(0, 2, 3, 8), (1, 3, 5, 16)]
    assert w.cut(((3, 4), (0, 4))) == [(1, 3, 4, 16)] and w.cut(None) == [] and w.pieces == ((0, 48), (1, 32))
    places, sizes = segments(m.buckets[0], 2, [((2, 5), (1, 3)), None])
    assert places == [[(0, 0, 8), (1, 0, 16)], []] and sizes == [8, 16]
    assert decode_needs(encode_needs([((0, 1), (0, 4)), ()]), m) == [[((0, 1), (0, 4)), ()]]
    bad_requests = ((b"[null]", "entries"), (b"[[[0, 6], [0, 4]], null]", "request for"),
                    (b"[[[0, 1]], null]", "request for"), (b"{}", "malformed"), (b"\x80", "malformed"))  # fmt: skip
    for bad, message in bad_requests:
        with pytest.raises(CheckpointError, match=message):
            decode_needs(bad, m)


def test_two_senders_send_an_engine_rank_exactly_what_it_asks_for() -> None:
    """Real gloo groups in threads: two senders holding uneven rows, one receiver asking for a box across their
    split, some columns, a whole tensor, a scalar and nothing of one; what it reads equals those slices."""
    torch.manual_seed(0)
    full = {"a": torch.randn(7, 5), "b": torch.randn(4, 3).to(torch.bfloat16), "c": torch.randn(6),
            "d": torch.randn(()), "e": torch.randn(3, 2)}  # fmt: skip
    split = {"a": ((0, 4), (1, 3)), "b": ((0, 2), (1, 2)), "c": ((1, 6),)}  # d, e: all on sender 0
    specs = [TensorSpec(n, tuple(t.shape), NAMES[t.dtype], split.get(n, ())) for n, t in full.items()]
    manifest = Manifest(9, plan_buckets(specs, bucket_bytes=64), senders=2)
    assert len(manifest.buckets) > 1
    asked: dict[str, Need] = {"a": ((3, 6), (1, 4)), "b": ((1, 4), (0, 3)), "c": (), "d": (), "e": None}
    sender = Sender("127.0.0.1", 0, timeout_s=30)
    name, got, errors = "test/group", {}, {}

    def senders(rank: int) -> None:
        group = sender.group(name, 2, 3) if rank == 0 else join_group(sender.rendezvous, name, 1, 2, 3, 30)
        rows = {n: dict((s, a) for s, a, _ in t.rows) for n, t in ((t.name, t) for t in specs)}
        mine = [[full[t.name][rows[t.name][rank] : rows[t.name][rank] + n] if t.shape else full[t.name]
                 for t in b for s, n in ((s, n) for s, n in (t.parts or ((0, t.shape[0] if t.shape else 1),)))
                 if s == rank] for b in manifest.buckets]  # fmt: skip
        try:
            errors.update(send({"engine": group}, rank, manifest, iter(mine)))
        except Exception as exc:  # the assertion below shows it
            errors[f"sender {rank}"] = repr(exc)

    def receiver() -> None:
        try:
            r = Receiver(sender.rendezvous, name, 2, 3, 30, max_bytes=1 << 20, senders=2)
            order = [t.name for b in r.manifest.buckets for t in b]
            got["coming"] = r.request([asked[n] for n in order])
            got.update(dict(r.tensors()))
        except Exception as exc:  # the assertion below shows it
            errors["receiver"] = repr(exc)

    threads = [threading.Thread(target=senders, args=(0,)), threading.Thread(target=senders, args=(1,)),
               threading.Thread(target=receiver)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    sender.close()
    assert errors == {} and set(got) == {"coming", "a", "b", "c", "d"}
    # only what was asked, each piece 8-aligned: a's row 3 from sender 0 (3 floats: 12 -> 16 bytes) and rows 4-5
    # from sender 1 (24); b's row 1 (3 bf16: 6 -> 8) and rows 2-3 (12 -> 16); c (24); d (4 -> 8); nothing of e
    assert got.pop("coming") == 16 + 24 + 8 + 16 + 24 + 8
    assert torch.equal(got["a"].read((slice(3, 6), slice(1, 4))), full["a"][3:6, 1:4])
    assert torch.equal(got["a"].read((slice(4, 5), slice(2, 3))), full["a"][4:5, 2:3])
    assert torch.equal(got["b"].read((slice(1, 4),)), full["b"][1:4]) and got["b"].shape == (4, 3)
    assert torch.equal(got["c"].read(), full["c"]) and torch.equal(got["d"].read(), full["d"])


def test_split_address() -> None:
    assert split_address("10.0.0.1:29600") == ("10.0.0.1", 29600)
    assert split_address("[fd00::1]:5") == ("fd00::1", 5)
    for bad in ("10.0.0.1", ":5", "h:0", "h:x", "h:70000"):
        with pytest.raises(ValueError):
            split_address(bad)
