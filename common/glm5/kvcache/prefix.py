"""Prefix-cache block hashes, one function for the worker that stores blocks and the router that predicts where
a prompt's blocks are (issue 37): block j's hash chains every token up to its end, so two prompts share a block's
hash exactly when they share all tokens before it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def _chain(parent: bytes, block: bytes) -> bytes:
    return hashlib.sha256(parent + block).digest()[:16]


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a block of `tokens` after the block whose hash is `parent` (b"" for the first)."""
    return _chain(parent, np.asarray(tokens, dtype=np.int64).tobytes())


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hashes of the blocks a worker may find cached for this prompt: its full blocks, less the last token
    (a prompt's last token is always computed, for its logits, as BlockManager.match_prefix does)."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()  # once: block_hash's bytes, sliced per block
    step = 8 * block_size
    out: list[bytes] = []
    parent = b""
    for j in range(max(len(token_ids) - 1, 0) // block_size):
        parent = _chain(parent, data[j * step : (j + 1) * step])
        out.append(parent)
    return out
