"""Headless-Service discovery shared by the router, the TITO gateway and the trainer (glm5.discovery)."""

from __future__ import annotations

import asyncio

import pytest
from glm5.discovery import Discovery, resolve_service


def test_every_record_becomes_a_grpc_target() -> None:
    found = asyncio.run(resolve_service("localhost:50051"))
    assert "127.0.0.1:50051" in found
    assert all(a == "127.0.0.1:50051" or (a.startswith("[") and a.endswith("]:50051")) for a in found)


def test_a_name_that_does_not_resolve_raises() -> None:
    with pytest.raises(OSError):
        asyncio.run(resolve_service("no-such-service.invalid:50051"))


def test_a_name_that_stops_resolving_keeps_its_last_records_with_the_static_ones() -> None:
    """One rule for the three users: a DNS blip keeps the servers last found (the trainer used to fall back to its
    static list, the gateway to every engine it ever saw)."""
    answers: list[set[str] | OSError] = [{"10.0.0.1:1", "10.0.0.2:1"}, OSError("blip"), OSError("blip"), {"10.0.0.3:1"}]

    async def resolve(target: str) -> set[str]:  # DNS answers in turn (a blip cannot be made on demand here)
        assert target == "workers.ns.svc:1"
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    found = Discovery(["10.0.0.9:1"], "workers.ns.svc:1", resolve=resolve)

    async def run() -> list[set[str]]:
        return [await found.addresses() for _ in range(4)]

    first, blip, still, back = asyncio.run(run())
    assert first == blip == still == {"10.0.0.1:1", "10.0.0.2:1", "10.0.0.9:1"}
    assert back == {"10.0.0.3:1", "10.0.0.9:1"} and not found.failing  # a server that left goes once it resolves
    assert asyncio.run(Discovery(["a:1"], None).addresses()) == {"a:1"}
