"""Receiving a streamed checkpoint (Worker.PushWeights): every byte accounted for, nothing left behind on error."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from glm5.errors import InvalidRequestError
from glm5.v1 import worker_pb2
from glm5_worker.server.push import STAGING_DIR, receive_push

FILES = {"config.json": b'{"a": 1}', "empty.txt": b"", "model.safetensors": bytes(range(256)) * 40}


def _header(files: dict[str, bytes], version: int = 3, **override: object) -> worker_pb2.PushWeightsChunk:
    entries = [worker_pb2.PushedFile(name=n, size=len(b), sha256=hashlib.sha256(b).hexdigest()) for n, b in
               files.items()]  # fmt: skip
    for entry in entries:
        for key, value in override.items():
            setattr(entry, key, value)
    return worker_pb2.PushWeightsChunk(header=worker_pb2.PushWeightsHeader(version=version, files=entries))


async def _stream(*chunks: worker_pb2.PushWeightsChunk) -> AsyncIterator[worker_pb2.PushWeightsChunk]:
    for c in chunks:
        yield c


def _data(blob: bytes, size: int) -> list[worker_pb2.PushWeightsChunk]:
    return [worker_pb2.PushWeightsChunk(data=blob[i : i + size]) for i in range(0, len(blob), size)]


class _Acceptance:
    """Counts the acceptances receive_push sends (the pusher's signal to send the data)."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> None:
        self.count += 1


def _receive(root: Path, *chunks: worker_pb2.PushWeightsChunk, max_bytes: int = 1 << 20) -> tuple[int, Path]:
    return asyncio.run(receive_push(_stream(*chunks), root, max_bytes, lambda v: None, _Acceptance()))


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_files_arrive_whole_in_any_chunking(tmp_path: Path, chunk: int) -> None:
    blob = b"".join(FILES.values())  # one stream: chunks cross file boundaries
    version, staged = _receive(tmp_path, _header(FILES), *_data(blob, chunk))
    assert version == 3 and staged.parent == tmp_path / STAGING_DIR
    assert {p.name: p.read_bytes() for p in staged.iterdir()} == FILES


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([worker_pb2.PushWeightsChunk(data=b"x")], "first message must be the header"),
        ([_header({})], "required"),
        ([_header({"../x": b"1"})], "plain file name"),
        ([_header({"a/b": b"1"})], "plain file name"),
        ([_header({".hidden": b"1"})], "plain file name"),
        ([_header(FILES, sha256="zz")], "64 lower-case hex"),
        ([_header(FILES, size=-1)], ">= 0"),
        ([_header({"big": b"1"}, size=2 << 20)], "over this worker's limit"),
        ([_header(FILES), *_data(b"".join(FILES.values()) + b"!", 64)], "more bytes than"),
        ([_header(FILES), *_data(b"".join(FILES.values())[:-1], 64)], "ended inside model.safetensors"),
        ([_header(FILES), *_data(b"".join(FILES.values())[::-1], 64)], "SHA-256 mismatch"),
        ([_header(FILES), _header(FILES)], "only the first message"),
        ([_header(FILES), worker_pb2.PushWeightsChunk(data=bytes(5 << 20))], "chunks of at most"),
    ],
)
def test_bad_pushes_are_refused_and_leave_nothing(tmp_path: Path, chunks: list, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidRequestError, match=message):
        _receive(tmp_path, *chunks)
    staging = tmp_path / STAGING_DIR
    assert not staging.exists() or not any(staging.iterdir())


def test_an_old_version_is_refused_before_a_byte_is_written(tmp_path: Path) -> None:
    def check(version: int) -> None:
        raise ValueError(f"not newer: {version}")

    accepted = _Acceptance()
    with pytest.raises(ValueError, match="not newer: 3"):
        asyncio.run(receive_push(_stream(_header(FILES), *_data(b"".join(FILES.values()), 64)), tmp_path, 1 << 20,
                                 check, accepted))  # fmt: skip
    assert not (tmp_path / STAGING_DIR).exists()
    assert accepted.count == 0  # refused before the pusher was told to send its data
