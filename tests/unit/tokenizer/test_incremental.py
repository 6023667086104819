from __future__ import annotations

from pathlib import Path

import pytest
from glm5.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Größe 你好 wörld <think>plan</think> 12 + 30 = 42"


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer(tiny_model)


def stream(tok: Tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tok, stop)
    pieces = [det.add(i) for i in ids]
    pieces.append(det.flush())
    return pieces, det


def test_streamed_pieces_join_to_the_full_text_and_never_split_characters(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    pieces, _ = stream(tok, ids, [])
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("stop", ["wörld", "42", "+ 3", "你"])
def test_stop_strings_end_the_text_before_them(tok: Tokenizer, stop: str) -> None:
    pieces, det = stream(tok, tok.encode(TEXT), [stop, "never-there"])
    assert "".join(pieces) == TEXT[: TEXT.index(stop)]
    assert det.stopped_by == stop


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tok: Tokenizer) -> None:
    pieces, det = stream(tok, tok.encode("12 + 30"), ["+ 4"])
    assert "".join(pieces) == "12 + 30" and det.stopped_by is None


def test_chat_template_and_fingerprint(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert prompt == "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think></think>"
    assert tok.encode("<think>")[0] == tok.token_id("<think>")
    assert len(tok.fingerprint) == 64
