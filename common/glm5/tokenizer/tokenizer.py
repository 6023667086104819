"""A checkpoint's tokenizer: tokenizer.json (HuggingFace `tokenizers`) + tokenizer_config.json (chat template).

Encoding and decoding go straight to the Rust tokenizer; the chat template is rendered with Jinja2 in a
sandbox, as transformers does. The fingerprint lets RL components refuse an engine whose tokenizer differs.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from glm5.errors import CheckpointError, InvalidRequestError

BOUNDED_PIECE_CHARS = 32 << 10
# the one message field whose special-token text stays markup: the model's own output sent back
MARKUP_FIELDS = frozenset({("assistant", "content")})


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(f"no tokenizer.json in {path}")
        cfg_file = path / "tokenizer_config.json"
        self._load(file.read_bytes(), cfg_file.read_text() if cfg_file.is_file() else "", str(file))

    @classmethod
    def from_files(cls, tokenizer_json: bytes, tokenizer_config_json: str, source: str = "tokenizer.json") -> Tokenizer:
        """The same tokenizer from the files' contents (a router gets them from a worker)."""
        tok = cls.__new__(cls)
        tok._load(tokenizer_json, tokenizer_config_json, source)
        return tok

    @property
    def files(self) -> tuple[bytes, str]:
        """(tokenizer.json, tokenizer_config.json) contents, as `from_files` takes them."""
        return self._json_bytes, self._config_text

    def _load(self, tokenizer_json: bytes, tokenizer_config_json: str, source: str) -> None:
        try:
            self._tok = HFTokenizer.from_str(tokenizer_json.decode())
        except Exception as exc:  # the Rust side raises plain Exceptions
            raise CheckpointError(f"cannot read {source}: {exc}") from exc
        self._json_bytes = tokenizer_json
        self._config_text = tokenizer_config_json
        try:
            self.config: dict[str, Any] = json.loads(tokenizer_config_json) if tokenizer_config_json else {}
        except ValueError as exc:
            raise CheckpointError(f"tokenizer_config.json next to {source} is not valid JSON: {exc}") from exc
        self.chat_template: str | None = self.config.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens = sorted(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)
        self._special_ids = {self._tok.token_to_id(t) for t in self.special_tokens}

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_bounded(self, text: str, max_tokens: int, add_special_tokens: bool = False,
                       field: str = "prompt") -> list[int]:  # fmt: skip
        """encode(), for untrusted input: a text of more than `max_tokens` tokens raises InvalidRequestError after
        reading about `max_tokens` tokens' worth of it, in pieces (memory stays bounded: a 2 MB text encoded whole
        holds ~160 MB of offsets and strings). HF tokenizers release the GIL in encode_batch only, so it is used
        throughout: from a thread, this leaves the event loop free."""
        if len(text) > BOUNDED_PIECE_CHARS:
            counted = 0
            for start in range(0, len(text), BOUNDED_PIECE_CHARS * 4):
                end = min(start + BOUNDED_PIECE_CHARS * 4, len(text))
                pieces = [text[i : i + BOUNDED_PIECE_CHARS] for i in range(start, end, BOUNDED_PIECE_CHARS)]
                counted += sum(len(e.ids) for e in self._tok.encode_batch(pieces, add_special_tokens=False))
                # a word cut at a piece edge may count one token more: allow that per piece
                if counted - 2 * (end // BOUNDED_PIECE_CHARS + 1) > max_tokens:
                    raise InvalidRequestError(field, f"more than {max_tokens} tokens (the limit here)")
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if len(ids) > max_tokens:
            raise InvalidRequestError(field, f"{len(ids)} tokens, more than {max_tokens} (the limit here)")
        return list(ids)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> tuple[list[int], str]:
        """The chat template applied and encoded (bounded as `encode_bounded`), with special tokens only where the
        template writes them: the text of a special token anywhere in a message (a system, user or tool message's
        content: a pasted document, a tool's output; an assistant's tool-call names and arguments and its
        `reasoning_content`, which history carries back from the client) or in the tool definitions (a third
        party's tool descriptions) is encoded as plain text, so no message can forge a turn (`<|assistant|>`), a
        tool call or the end of the thinking. Returns (ids, the rendered text).

        Those strings go through the template as placeholders carrying a per-call nonce (unguessable, so a message
        cannot write one) and are encoded on their own with special-token parsing off. Only an assistant
        message's `content` keeps its markup (MARKUP_FIELDS: the model's own output sent back, whose `</think>`
        the template splits); a tool call's arguments are the client's to fill in, and an argument that echoes
        fetched text must not close the call and open a user turn."""
        nonce = secrets.token_hex(8)
        literals: list[str] = []

        def hide(match: re.Match[str]) -> str:
            literals.append(match.group(0))
            return f"\ue000{nonce}:{len(literals) - 1}\ue001"

        def shield(value: Any) -> Any:
            if not self.special_tokens:  # (an empty pattern would match everywhere)
                return value
            if isinstance(value, str):
                return self._special_re.sub(hide, value)
            if isinstance(value, dict):
                return {shield(k): shield(v) for k, v in value.items()}
            return [shield(v) for v in value] if isinstance(value, list) else value

        # every field, not a list of the ones this template renders: another checkpoint's template may render
        # a message's `name` or a call's `id`. The role is the template's switch, never text.
        shielded = [
            {k: v if k == "role" or (m.get("role"), k) in MARKUP_FIELDS else shield(v) for k, v in m.items()}
            if isinstance(m, dict) else m
            for m in messages
        ]  # fmt: skip
        text = self.apply_chat_template(shielded, tools=shield(tools), **kwargs)
        if not literals:
            return self.encode_bounded(text, max_tokens, field="messages"), text
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)  # text, index, text, index, ..., text
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                literal = literals[int(part)]
                ids += self.encode_literal(literal)
                parts[i] = literal
            elif part:
                ids += self.encode_bounded(part, max_tokens, field="messages")
            if len(ids) > max_tokens:
                raise InvalidRequestError("messages", f"more than {max_tokens} tokens (the limit here)")
        return ids, "".join(parts)

    @cached_property
    def _special_re(self) -> re.Pattern[str]:
        # longest first: a token whose text starts another's must not win over it
        return re.compile("|".join(re.escape(t) for t in sorted(self.special_tokens, key=len, reverse=True)))

    def encode_literal(self, text: str) -> list[int]:
        """`text` as plain text: a special token's string in it is encoded as the characters it is made of (for
        data that must not become markup: a tool's output)."""
        return list(self._literal_tok.encode(text, add_special_tokens=False).ids)

    @cached_property
    def _literal_tok(self) -> HFTokenizer:
        """The same tokenizer with special-token parsing off (a copy: the flag is per tokenizer, and encode runs
        on several threads)."""
        tok = HFTokenizer.from_str(self._json_bytes.decode())
        tok.encode_special_tokens = True
        return tok

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def eos_token_ids(self) -> list[int]:
        names = self.config.get("eos_tokens") or [self.config.get("eos_token")]
        return [i for name in names if name and (i := self._tok.token_to_id(name)) is not None]

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over tokenizer.json, the chat template and the special tokens."""
        h = hashlib.sha256()
        h.update(self._json_bytes)
        h.update(b"\0" + (self.chat_template or "").encode())
        h.update(b"\0" + "\n".join(self.special_tokens).encode())
        return h.hexdigest()

    @cached_property
    def _compiled_template(self) -> Template:
        """Compiled once: compiling the template is most of the cost of applying it."""
        assert self.chat_template is not None
        try:
            return _compile(self.chat_template)
        except TemplateError as exc:
            raise InvalidRequestError("messages", f"chat template does not compile: {exc}") from exc

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        if not self.chat_template:
            raise InvalidRequestError("messages", "this model's tokenizer_config.json has no chat_template")
        try:
            return str(
                self._compiled_template.render(
                    messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
                )
            )
        except TemplateError as exc:
            raise InvalidRequestError("messages", f"chat template failed: {exc}") from exc


def _compile(source: str) -> Template:
    return _template_env().from_string(source)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _template_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env
