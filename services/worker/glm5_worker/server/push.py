"""Receiving a pushed checkpoint (Worker.PushWeights): the trainer streams a published version's files; they are
staged under the weights root, every size and SHA-256 checked, before the update reads them like any other
checkpoint folder. Bounded: the file count, each name (a plain file name), the declared total (a few times the
served weights) and each chunk; bytes beyond a file's declared size are refused as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import secrets
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import IO, Any

from glm5.errors import InvalidRequestError
from glm5.v1 import worker_pb2

STAGING_DIR = ".pushed"  # under the weights root; a worker start clears it
MAX_FILES = 1024
MAX_CHUNK_BYTES = 4 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _check_header(header: worker_pb2.PushWeightsHeader, max_bytes: int) -> None:
    files = header.files
    if not files:
        raise InvalidRequestError("header.files", "required: the checkpoint's files")
    if len(files) > MAX_FILES:
        raise InvalidRequestError("header.files", f"at most {MAX_FILES} files, got {len(files)}")
    names = set()
    for i, f in enumerate(files):
        if not _NAME.match(f.name) or ".." in f.name:
            raise InvalidRequestError(f"header.files[{i}].name", "a plain file name (letters, digits, '._-')")
        if f.name in names:
            raise InvalidRequestError(f"header.files[{i}].name", f"{f.name} is listed twice")
        names.add(f.name)
        if f.size < 0:
            raise InvalidRequestError(f"header.files[{i}].size", "must be >= 0")
        if not _SHA256.match(f.sha256):
            raise InvalidRequestError(f"header.files[{i}].sha256", "64 lower-case hex digits")
    total = sum(f.size for f in files)
    if total > max_bytes:
        raise InvalidRequestError("header.files", f"{total} bytes in all, over this worker's limit of {max_bytes}")


async def receive_push(
    chunks: AsyncIterator[worker_pb2.PushWeightsChunk],
    root: Path,
    max_bytes: int,
    check_version: Callable[[int], None],
    accepted: Callable[[], Awaitable[None]],
) -> tuple[int, Path]:
    """(version, staged folder) once every declared byte arrived intact; the caller deletes the folder. On any
    error the staged bytes are gone and InvalidRequestError says what was wrong (check_version's own errors pass
    through before a byte is written). `accepted` is awaited once the header passed: it tells the pusher to send
    the data (a refusal before it reaches the pusher as its status, not as a write failing against it)."""
    first = await anext(aiter(chunks), None)
    if first is None or first.WhichOneof("part") != "header":
        raise InvalidRequestError("header", "the first message must be the header")
    header = first.header
    _check_header(header, max_bytes)
    check_version(header.version)
    await accepted()
    staged = root / STAGING_DIR / f"v{header.version}-{secrets.token_hex(4)}"
    await asyncio.to_thread(staged.mkdir, parents=True)
    try:
        await _receive_files(chunks, header, staged)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, staged, True)
        raise
    return header.version, staged


async def _receive_files(
    chunks: AsyncIterator[worker_pb2.PushWeightsChunk], header: worker_pb2.PushWeightsHeader, staged: Path
) -> None:
    files = list(header.files)
    index, written = 0, 0
    digest = hashlib.sha256()
    out: IO[bytes] | None = await asyncio.to_thread(open, staged / files[0].name, "wb")

    async def close_complete_files() -> None:
        """Every file whose declared bytes are all written (empty ones too) is closed and checked."""
        nonlocal out, index, written, digest
        while index < len(files) and written == files[index].size:
            out = await _finish(out, digest, files[index], staged, files[index + 1 :])
            index, written, digest = index + 1, 0, hashlib.sha256()

    try:
        async for chunk in chunks:
            if chunk.WhichOneof("part") != "data":
                raise InvalidRequestError("data", "only the first message is a header")
            data = chunk.data
            if len(data) > MAX_CHUNK_BYTES:
                raise InvalidRequestError("data", f"chunks of at most {MAX_CHUNK_BYTES} bytes")
            while data:
                await close_complete_files()
                if index == len(files):
                    raise InvalidRequestError("data", "more bytes than the header's files declare")
                take = data[: files[index].size - written]
                await asyncio.to_thread(_write, out, digest, take)
                written += len(take)
                data = data[len(take) :]
        await close_complete_files()
        if index < len(files):
            raise InvalidRequestError("data", f"the stream ended inside {files[index].name} ({written} of "
                                      f"{files[index].size} bytes)")  # fmt: skip
    finally:
        if out is not None:
            with contextlib.suppress(OSError):
                out.close()


def _write(out: IO[bytes] | None, digest: Any, data: bytes) -> None:
    assert out is not None
    digest.update(data)
    out.write(data)


async def _finish(out: IO[bytes] | None, digest: Any, f: worker_pb2.PushedFile, staged: Path,
                  rest: list[worker_pb2.PushedFile]) -> IO[bytes] | None:  # fmt: skip
    """Closes a complete file, checks its digest, opens the next (None after the last)."""
    assert out is not None
    await asyncio.to_thread(out.close)
    if digest.hexdigest() != f.sha256:
        raise InvalidRequestError("data", f"{f.name}: SHA-256 mismatch (the bytes were damaged or reordered)")
    return await asyncio.to_thread(open, staged / rest[0].name, "wb") if rest else None


def clear_staging(root: Path | None) -> None:
    """Pushes a previous run of this worker left half-received (a crash mid-stream)."""
    if root is not None:
        shutil.rmtree(root / STAGING_DIR, ignore_errors=True)
