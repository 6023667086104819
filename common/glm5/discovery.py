"""Where a set of servers is: a static list of addresses plus a headless Service's DNS records, as the router finds
its workers, the TITO gateway and the trainer their rollout engines.

One rule for a name that does not resolve (a DNS blip; some resolvers answer NXDOMAIN while a headless Service has
no ready pod): the records last found stand, with the static ones, until it resolves again, so a blip neither
drops live servers nor brings back ones that left long ago.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable

log = logging.getLogger(__name__)


async def resolve_service(target: str) -> set[str]:
    """host:port of a headless Service -> one host:port per A/AAAA record (IPv6 in brackets, as gRPC targets
    want them). Raises OSError when the name does not resolve."""
    host, _, port = target.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    return {f"[{s[0]}]:{port}" if family == socket.AF_INET6 else f"{s[0]}:{port}" for family, *_, s in infos}


class Discovery:
    """`static` addresses plus those `dns` (host:port of a headless Service, or None) resolves to."""

    def __init__(
        self,
        static: Iterable[str],
        dns: str | None,
        what: str = "servers",
        resolve: Callable[[str], Awaitable[set[str]]] = resolve_service,
    ) -> None:
        self.static, self.dns, self.what, self._resolve = frozenset(static), dns, what, resolve
        self.found: frozenset[str] = frozenset()  # the last records `dns` resolved to
        self.failing = False  # the last lookup failed (logged once per run of failures)

    async def addresses(self) -> set[str]:
        if self.dns:
            try:
                self.found = frozenset(await self._resolve(self.dns))
                if self.failing:
                    log.info("%s resolves again (%d %s)", self.dns, len(self.found), self.what)
                self.failing = False
            except OSError as exc:
                if not self.failing:
                    log.warning("cannot resolve %s (%s): keeping the %d %s last found", self.dns, exc,
                                len(self.found), self.what)  # fmt: skip
                self.failing = True
        return set(self.static | self.found)
