"""glm5.weight_sync's wire format: what a receiver accepts from a peer, and how buckets are laid out."""

from __future__ import annotations

import json

import pytest
import torch
from glm5.errors import CheckpointError
from glm5.weight_sync import DTYPES, Manifest, Received, TensorSpec, plan_buckets, segments, split_address


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
        ([[["w", [3, 2], "F32", [], [[0, 4], [0, 2]]]]], "box"),  # beyond the tensor
        ([[["w", [3, 2], "F32", [], [[0, 3]]]]], "box"),  # not one range per dimension
        ([[["w", [3], "F32", [[0, 3]], [[0, 2]]]]], "box"),  # split over senders and boxed
    ],
)
def test_a_peers_manifest_is_checked(buckets: object, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        Manifest.from_bytes(json.dumps({"version": 1, "senders": 2, "buckets": buckets}).encode())
    with pytest.raises(CheckpointError, match="malformed"):
        Manifest.from_bytes(b"\x80not json")


def test_a_forwarded_checkpoints_stored_dtypes_are_checked() -> None:
    spec = TensorSpec("w", (4, 2), "F8_E4M3", box=((0, 2), (0, 2)))
    m = Manifest(
        1, ((spec,),), stored={"w": "F8_E4M3", "w_scale_inv": "F32", "x": "BF16"}, quant={"quant_method": "fp8"}
    )
    back = Manifest.from_bytes(m.to_bytes())
    assert back == m and back.dtypes() == m.stored and spec.nbytes == 4 and spec.sent_shape == (2, 2)
    for stored, message in (({"x": "F32"}, "missing"), ({"w": "F8_E4M3", "../x": "F32"}, "bad"),
                            ({"w": "F8_E4M3", "x": "Q9"}, "bad")):  # fmt: skip
        with pytest.raises(CheckpointError, match=message):
            Manifest.from_bytes(Manifest(1, ((spec,),), stored=stored).to_bytes())
    raw = json.loads(m.to_bytes())
    raw["quant"] = [1]
    with pytest.raises(CheckpointError, match="malformed"):
        Manifest.from_bytes(json.dumps(raw).encode())


def test_split_address() -> None:
    assert split_address("10.0.0.1:29600") == ("10.0.0.1", 29600)
    assert split_address("[fd00::1]:5") == ("fd00::1", 5)
    for bad in ("10.0.0.1", ":5", "h:0", "h:x", "h:70000"):
        with pytest.raises(ValueError):
            split_address(bad)
