"""schemathesis against the router's OpenAPI description (GET /openapi.json): requests generated from the three
endpoints' schemas, valid and invalid, never get a 5xx. The long run (thousands of cases) is in
docs/benchmarks.md k; this one is its smaller version."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.procs import start_router, start_worker, stop


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> Iterator[str]:
    worker, target = start_worker(tiny_model, "--max-model-len", "256", "--kv-cache-bytes", "16MiB")
    router, _, url = start_router([target], "--default-max-new-tokens", "4")
    try:
        yield url.removesuffix("/v1")
    finally:
        stop(router)
        stop(worker)


def test_generated_requests_get_no_server_error(base: str, tmp_path: Path) -> None:
    binary = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert binary, "schemathesis is a dev dependency"
    proc = subprocess.run([binary, "run", f"{base}/openapi.json", "--checks", "not_a_server_error",
                           "--max-examples", "8", "--seed", "7", "--report-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    summary = proc.stdout[-3000:]
    assert proc.returncode == 0, summary
    assert "generated" in summary and " passed" in summary and "failed" not in summary.split("Test cases:")[-1]
