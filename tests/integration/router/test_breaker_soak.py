"""A soak at saturation on one worker whose soft signals are over their thresholds the whole time (thresholds set
near zero): the breaker must never take the only worker out, every request is served, and /health stays ok.
(The full 10-minute soak with the default thresholds is benchmarks/breaker_soak.py, docs/benchmarks.md l.)"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request
from pathlib import Path

import openai

from tests.helpers.procs import start_router, start_worker, stop

SECONDS = 15


def test_one_worker_is_never_ejected_at_saturation(tiny_model: Path, tmp_path: Path) -> None:
    worker, target = start_worker(tiny_model, "--max-model-len", "512", "--kv-cache-bytes", "32MiB")
    flags = ("--breaker-sustained-seconds", "0.5", "--breaker-entropy-drift", "0.000001", "--breaker-token-jitter-ms",
             "0.001")  # fmt: skip
    router, _, base = start_router([target], *flags, log=tmp_path / "router.log")
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    deadline = time.monotonic() + SECONDS
    states: set[str] = set()
    statuses: set[str] = set()

    def user(i: int) -> tuple[int, int]:
        ok = failed = 0
        while time.monotonic() < deadline:
            try:
                client.completions.create(model="glm5-tiny", prompt=f"{i} + 1 =", max_tokens=16)
                ok += 1
            except openai.APIError:
                failed += 1
        return ok, failed

    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            users = [pool.submit(user, i) for i in range(4)]
            while time.monotonic() < deadline:
                with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=5) as r:
                    health = json.load(r)
                statuses.add(health["status"])
                states.add(health["workers"][0]["breaker"])
                time.sleep(0.3)
            results = [u.result() for u in users]
        with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=5) as r:
            reason = json.load(r)["workers"][0]["reason"]
    finally:
        stop(router)
        stop(worker)
    assert sum(ok for ok, _ in results) > 20 and sum(f for _, f in results) == 0, results
    assert states == {"closed"} and statuses == {"ok"}, (states, statuses)
    assert "kept in rotation" in reason  # the signals were over their thresholds: the ejection was withheld
