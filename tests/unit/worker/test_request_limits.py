"""What the worker's gRPC layer refuses before anything reaches the engine: the limits that hold for callers who
skip the router (docs/security.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from glm5.errors import InvalidRequestError
from glm5.v1 import common_pb2, worker_pb2
from glm5_worker.server.service import MAX_FORMAT_CHARS, sampling_from_proto, weights_location


def test_an_oversized_output_format_is_refused() -> None:
    ok = worker_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        structured_output=common_pb2.StructuredOutput(regex="a" * MAX_FORMAT_CHARS)))  # fmt: skip
    assert sampling_from_proto(ok, 16).output_format is not None
    big = worker_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        structured_output=common_pb2.StructuredOutput(lark_grammar="a" * (MAX_FORMAT_CHARS + 1))))  # fmt: skip
    with pytest.raises(InvalidRequestError, match="lark_grammar"):
        sampling_from_proto(big, 16)


def test_weights_locations_stay_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "v1").mkdir(parents=True)
    (root / "out").symlink_to(tmp_path)
    assert weights_location(str(root / "v1"), root) == (root / "v1").resolve()
    assert weights_location("v1", root) == (root / "v1").resolve()  # relative: from the root
    for location, message in [(str(tmp_path), "inside the weights root"), (str(root / "out"), "inside"),
                              (f"{root}/v1/../v1", "'..'"), ("", "required")]:  # fmt: skip
        with pytest.raises(InvalidRequestError, match=message):
            weights_location(location, root)
    with pytest.raises(InvalidRequestError, match="--weights-root"):
        weights_location(str(root / "v1"), None)
