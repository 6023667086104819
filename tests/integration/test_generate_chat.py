"""`glm5 generate --chat`, the README's line (issue 34, item 8): `glm5 generate "What is 12 + 30?"` sent a raw
completion, which the demo model continues with a wrong sum; with --chat the router applies the chat template and
the demo model answers 42. A worker has no chat template: --chat to one says so."""

from __future__ import annotations

import subprocess
import sys

from glm5.model.presets import default_model_path

from tests.helpers.procs import start_router, start_worker, stop


def _generate(target: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "glm5_cli", "generate", "--target", target, "--temperature", "0",
                           *args, "What is 12 + 30?"], capture_output=True, text=True, timeout=120)  # fmt: skip


def test_generate_chat_answers_the_readme_question_through_a_router() -> None:
    worker, worker_target = start_worker(default_model_path(), "--max-model-len", "512", "--kv-cache-bytes", "16MiB")
    # the demo model was trained to reason first: glm5 serve's router thinks deep by default, a bare one does not
    router, router_target, _ = start_router([worker_target], "--thinking-policy", "deep")
    try:
        chat = _generate(router_target, "--chat")
        assert chat.returncode == 0, chat.stderr[-2000:]
        assert "The answer is 42." in chat.stdout, chat.stdout
        schema = '{"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}'
        structured = _generate(router_target, "--chat", "--json-schema", schema)
        assert structured.returncode == 0 and '{"answer": 42}' in structured.stdout, structured.stdout
        light = _generate(router_target, "--chat", "--thinking", "light")  # the request's mode over the policy
        assert light.returncode == 0 and "The answer is" in light.stdout, light.stderr[-2000:]
        refused = _generate(worker_target, "--chat")
        assert refused.returncode == 1 and "--chat needs a router" in refused.stderr, refused.stderr
    finally:
        stop(router)
        stop(worker)
