"""Split streamed model text into reasoning (inside <think>...</think>) and content deltas, also when a tag
arrives split across chunks."""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True, slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (a tag that may continue)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Feed text deltas in order; each call returns what can be attributed so far. Text that might be the
    start of a tag is held back until the next delta (or `finish`) decides."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self.in_reasoning = in_reasoning  # the prompt may already have opened <think>
        self._held = ""

    def feed(self, delta: str) -> Split:
        text = self._held + delta
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            tag = THINK_CLOSE if self.in_reasoning else THINK_OPEN
            at = text.find(tag)
            if at >= 0:
                (reasoning if self.in_reasoning else content).append(text[:at])
                text = text[at + len(tag) :]
                self.in_reasoning = not self.in_reasoning
                continue
            keep = _partial_suffix(text, tag)
            (reasoning if self.in_reasoning else content).append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """The stream ended: whatever was held back was not a tag after all."""
        held, self._held = self._held, ""
        return Split(held, "") if self.in_reasoning else Split("", held)
