"""Headless-Service discovery shared by the router, the TITO gateway and the trainer."""

from __future__ import annotations

import asyncio

import pytest
from glm5.serving import resolve_service


def test_every_record_becomes_a_grpc_target() -> None:
    found = asyncio.run(resolve_service("localhost:50051"))
    assert "127.0.0.1:50051" in found
    assert all(a == "127.0.0.1:50051" or (a.startswith("[") and a.endswith("]:50051")) for a in found)


def test_a_name_that_does_not_resolve_raises() -> None:
    with pytest.raises(OSError):
        asyncio.run(resolve_service("no-such-service.invalid:50051"))
