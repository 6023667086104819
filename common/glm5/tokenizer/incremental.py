"""Streaming detokenisation with stop strings.

Decoding token by token breaks multi-byte characters and merges that depend on neighbours, so each step
decodes a small window (vLLM's prefix/read offsets) and emits only text that cannot change any more. Text
that could be the start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glm5.tokenizer.tokenizer import Tokenizer


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = False
    ids: list[int] = field(default_factory=list)
    text: str = ""  # all text decided so far (emitted + held back)
    emitted: int = 0  # characters of `text` already handed out
    stopped_by: str | None = None
    _prefix: int = 0
    _read: int = 0

    def add(self, token_id: int) -> str:
        """Adds a token; returns the text safe to emit now ("" while waiting or after a stop string)."""
        if self.stopped_by is not None:
            return ""
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = dec(self.ids[self._prefix : self._read], skip)
        new_text = dec(self.ids[self._prefix :], skip)
        # an incomplete UTF-8 sequence decodes to U+FFFD: wait for the next token
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        if self.stop:
            start = max(0, self.emitted - max(map(len, self.stop)) + 1)
            found = [(pos, s) for s in self.stop if (pos := self.text.find(s, start)) >= 0]
            if found:
                pos, self.stopped_by = min(found)
                self.text = self.text[:pos]
                out = self.text[self.emitted :]
                self.emitted = len(self.text)
                return out
            hold = _partial_stop_suffix(self.text, self.stop)
            end = len(self.text) - hold
        else:
            end = len(self.text)
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def flush(self) -> str:
        """Text held back at the end of generation (a stop-string prefix that never completed)."""
        if self.stopped_by is not None:
            return ""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


def _partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
