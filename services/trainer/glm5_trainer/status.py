"""The trainer's status endpoint (`glm5 trainer --status-port`): GET /status is the run's progress as JSON (the
operator polls it for an RLJob's status: steps taken, the version the engines serve, the last push), GET /healthz
answers while the event loop does (the trainer pod's readiness probe). Read-only, no request bodies, localhost
unless told otherwise. On the other hosts of a trainer over several, the first rank of each answers GET /healthz
alone (`serve_health`): its pod's probe then says the rank runs, and the operator asks host 0 for the progress."""

from __future__ import annotations

import http.server
import threading
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


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.path == "/healthz"
        body = b"ok\n" if ok else b"not found: this host's ranks report through host 0\n"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a probe every few seconds is not news


def serve_health(host: str, port: int) -> http.server.ThreadingHTTPServer:
    """GET /healthz on host:port from a daemon thread (the rank's main thread runs what rank 0 sends)."""
    server = http.server.ThreadingHTTPServer((host, port), _Health)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="glm5-health", daemon=True).start()
    return server
