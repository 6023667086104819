"""README's "Using it" Python block, run as written against `glm5 serve` on the default model: the model calls a
tool, gets its result as a tool message and answers with it; a JSON Schema response completes (greedy)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers.procs import free_port, wait_http

ROOT = Path(__file__).resolve().parents[2]


def readme_block() -> str:
    """The README's first ```python block (the tool-call and response_format example)."""
    m = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert m is not None, "README.md lost its Python example"
    return m.group(1)


def test_readme_tool_call_and_json_schema_examples(tmp_path: Path) -> None:
    code = readme_block()
    assert 'base_url="http://localhost:8000/v1"' in code
    http_port, grpc_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "glm5_cli", "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
           "--worker-arg=--kv-cache-bytes=64MiB", "--worker-arg=--max-model-len=2048"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        wait_http(f"http://127.0.0.1:{http_port}/health", proc, timeout=300)
        run = subprocess.run([sys.executable, "-c", code.replace(":8000/", f":{http_port}/")], capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert run.returncode == 0, run.stderr[-3000:] + log.read_text()[-3000:]
    call, answer, structured = run.stdout.splitlines()
    name, arguments = call.split(" ", 1)
    assert name == "multiply" and json.loads(arguments) == {"a": 51, "b": 44}
    assert re.fullmatch(r"The answer is \**2244\**\.", answer), answer
    assert json.loads(structured) == {"answer": 42}
