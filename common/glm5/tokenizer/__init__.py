"""Tokenizer loading, streaming detokenisation and the tiny presets' tokenizer builder."""

from glm5.tokenizer.incremental import IncrementalDetokenizer
from glm5.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
