"""What the HTTP API accepts before any handler looks at a request: the body as strict JSON and the headers it
reads as text. Anything that is not valid Unicode is a 400 here, so no later layer (protobuf, hashing, Redis,
logging) meets a string it cannot encode: one such string once stopped the whole queue (issue 33)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from glm5_router.frontend import MAX_ID_CHARS, check_id
from glm5_router.http.errors import ApiError


def parse_body(raw: bytes, max_messages: int) -> dict[str, Any]:
    """The request body as a JSON object. orjson is the only parser: it refuses what json's would let through
    (lone surrogates, NaN and Infinity, nesting past 1,024 levels, which json's parser meets as a RecursionError)."""
    # the event loop parses the body: refuse a chat far over the message limit before building 100,000 dicts
    # (a key spelt with escapes is not counted here; the limit after parsing still holds for it)
    if raw.count(b'"role"') > max_messages:
        raise ApiError(400, f"messages: at most {max_messages}", "invalid_request_error", "messages")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON (UTF-8, no lone surrogates): {exc}",
                       "invalid_request_error") from None  # fmt: skip
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_request_error")
    return body


def text_header(request: web.Request, name: str, max_chars: int = MAX_ID_CHARS) -> str | None:
    """A header the router uses as text (an id): None when absent; 400 when it is not UTF-8 (aiohttp hands such
    bytes over as surrogate escapes), has control characters or is longer than `max_chars`."""
    value = request.headers.get(name)
    if value is None:
        return None
    return check_id(name, value, max_chars)


__all__ = ["parse_body", "text_header"]
