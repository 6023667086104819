"""Typed errors users see. Each message says what is wrong and, where it can, what to do."""

from __future__ import annotations

from collections.abc import Iterable


class Glm5Error(Exception):
    """Base class of the errors this project raises on purpose."""


class ConfigError(Glm5Error, ValueError):
    """A configuration value is invalid (model config, engine flags, RoPE scaling)."""


class CheckpointError(Glm5Error):
    """A checkpoint is missing, unreadable, of another architecture, or has tensors of the wrong shape."""


class InvalidRequestError(Glm5Error, ValueError):
    """A request field is invalid. `field` names it so the API can say which one."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_vocabulary(field: str, ids: Iterable[int], size: int) -> None:
    """Every id in 0..size-1, else InvalidRequestError naming the first that is not (one rule wherever ids come
    in: a prompt, logit bias, stop tokens, a detokenize call)."""
    bad = next((t for t in ids if not 0 <= t < size), None)
    if bad is not None:
        raise InvalidRequestError(field, f"token id {bad} is outside the vocabulary (0..{size - 1})")


class CapacityError(Glm5Error):
    """The request can never fit (KV pool) or the queue is full; retrying later may help."""


class DeadlineError(Glm5Error):
    """A request waited past its deadline before it could be served."""


class UnavailableError(Glm5Error):
    """No worker could serve the request, or a stream broke after tokens were sent (never retried then)."""


class BindError(Glm5Error, OSError):
    """A server cannot listen on its address: the port is taken or the address is not on this host."""


MAX_MESSAGE_CHARS = 1000  # an error may echo user input (a pattern, a schema); gRPC metadata holds ~8 KiB


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut to `limit` characters, saying how much was left out."""
    return message if len(message) <= limit else f"{message[:limit]}... ({len(message) - limit} more characters)"
