"""Split streamed model text into reasoning (inside <think>...</think>) and content deltas, also when a tag
arrives split across chunks, and (for chat) when the model closes a think block it never opened: a model that
always reasons does so even after a prompt that ended its think block (`<think></think>`), and what it writes before
that lone `</think>` is reasoning, as vLLM's deepseek_r1 / glm45 parsers read it."""

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


LONE_CLOSE_HOLD_CHARS = 512  # how much of an answer waits to see whether a lone </think> ends it as reasoning


class ReasoningParser:
    """Feed text deltas in order; each call returns what can be attributed so far. Text that might be the
    start of a tag is held back until the next delta (or `finish`) decides. With `lone_close`, the first
    LONE_CLOSE_HOLD_CHARS of an output that does not start inside <think> wait too: if a `</think>` comes before
    any `<think>`, they were reasoning; otherwise (no tag by then, or the stream ends) they are content, and a
    `</think>` after that is dropped, never passed on as text."""

    def __init__(self, in_reasoning: bool = False, lone_close: bool = False,
                 hold_chars: int = LONE_CLOSE_HOLD_CHARS) -> None:  # fmt: skip
        self.in_reasoning = in_reasoning  # the prompt may already have opened <think>
        self._held = ""
        self._undecided = lone_close and not in_reasoning
        self._lone_close = lone_close
        self._hold_chars = hold_chars

    def feed(self, delta: str) -> Split:
        text = self._held + delta
        self._held = ""
        if self._undecided:
            opened, closed = text.find(THINK_OPEN), text.find(THINK_CLOSE)
            if 0 <= closed <= self._hold_chars and (opened < 0 or closed < opened):
                self._undecided = False
                rest = self._split(text[closed + len(THINK_CLOSE) :])
                return Split(text[:closed] + rest.reasoning, rest.content)
            if opened < 0 and len(text) <= self._hold_chars:
                self._held = text
                return Split()
            self._undecided = False
        return self._split(text)

    def _split(self, text: str) -> Split:
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            tags = [THINK_CLOSE] if self.in_reasoning else [THINK_OPEN, *([THINK_CLOSE] if self._lone_close else [])]
            found = [(i, tag) for tag in tags if (i := text.find(tag)) >= 0]
            if found:
                at, tag = min(found)
                (reasoning if self.in_reasoning else content).append(text[:at])
                text = text[at + len(tag) :]
                if tag == THINK_OPEN or self.in_reasoning:
                    self.in_reasoning = not self.in_reasoning
                continue  # (a lone close after the answer began is markup, not content: dropped)
            keep = max(_partial_suffix(text, tag) for tag in tags)
            (reasoning if self.in_reasoning else content).append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return Split("".join(reasoning), "".join(content))

    def pending(self) -> str:
        """Text held back and not attributed yet; it is given up (the caller passes it on as it sees fit)."""
        held, self._held = self._held, ""
        self._undecided = False
        return held

    def finish(self) -> Split:
        """The stream ended: whatever was held back was not a tag after all (nor reasoning, without a close)."""
        held, self._held = self._held, ""
        self._undecided = False
        return Split(held, "") if self.in_reasoning else Split("", held)
