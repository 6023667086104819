"""Server-sent events carry JSON that line-splitting clients can read."""

from __future__ import annotations

import json

from glm5_router.http.streaming import sse_event


def test_line_separators_are_escaped_and_the_json_is_unchanged() -> None:
    payload = {"text": "a\u2028b\u2029c\u0085d é"}
    event = sse_event(payload)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    body = event.decode()[len("data: ") : -2]
    assert not any(ch in body for ch in "\u2028\u2029\u0085\n\r")  # one line, whatever splitter the client uses
    assert json.loads(body) == payload and "é" in body  # other non-ASCII text stays as it is
