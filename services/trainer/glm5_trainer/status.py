"""The trainer's status endpoint (`glm5 trainer --status-port`): GET /status is the run's progress as JSON (the
operator polls it for an RLJob's status: steps taken, the version the engines serve, the last push), GET /healthz
answers while the event loop does (the trainer pod's readiness probe). Read-only, no request bodies, localhost
unless told otherwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web


async def serve_status(host: str, port: int, progress: Callable[[], dict[str, Any]]) -> web.AppRunner:
    async def status(_: web.Request) -> web.Response:
        return web.json_response(progress())

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application(client_max_size=1024)  # nothing here reads a body
    app.router.add_get("/status", status)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
