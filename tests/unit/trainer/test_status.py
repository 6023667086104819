"""`glm5 trainer --status-port`: progress as JSON for the operator, a health check for the pod's probe."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from glm5_trainer.status import serve_status

from tests.helpers.procs import free_port


def test_status_endpoint_serves_progress_and_nothing_else() -> None:
    progress = {"phase": "training", "steps": 3, "targetSteps": 10, "policyVersion": 2, "lastSyncTime": None}

    async def go() -> None:
        port = free_port()
        runner = await serve_status("127.0.0.1", port, lambda: progress)
        try:

            def get(path: str, data: bytes | None = None) -> tuple[int, bytes]:
                try:
                    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data),
                                                timeout=5) as r:  # fmt: skip
                        return r.status, r.read()
                except urllib.error.HTTPError as exc:
                    return exc.code, exc.read()

            status, body = await asyncio.to_thread(get, "/status")
            assert status == 200 and json.loads(body) == progress
            progress["steps"] = 4  # read fresh on every request
            assert json.loads((await asyncio.to_thread(get, "/status"))[1])["steps"] == 4
            assert await asyncio.to_thread(get, "/healthz") == (200, b"ok\n")
            assert (await asyncio.to_thread(get, "/status", b"x" * 10))[0] == 405  # read-only
            assert (await asyncio.to_thread(get, "/admin"))[0] == 404
        finally:
            await runner.cleanup()

    asyncio.run(go())
