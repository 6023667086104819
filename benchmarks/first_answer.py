"""A newcomer's first answer: `glm5 serve` on the default model, from the command to the first chat answer, cold
(an empty compile cache) and warm (the cache the cold run left), and the decode speed before and after the
worker switches to its compiled steps (it serves eagerly while they compile in the background).

    python benchmarks/first_answer.py --rounds 3          # cold, warm, cold, warm, ... (medians printed)
    python benchmarks/first_answer.py --smoke             # one eager start: the whole path, no compile

Each run: a fresh `glm5 serve` (its own ports; the worker's --compile-cache-dir is a fresh directory for a cold run,
the previous cold run's for a warm one); `first answer` is when the router first answers the README's question
(`What is 12 + 30?`, temperature 0); `compiled` when the worker logs that its decode steps run compiled; the ms/token
columns time a 64-token greedy completion right after the first answer and again once compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.procs import free_port

QUESTION = {"messages": [{"role": "user", "content": "What is 12 + 30?"}], "max_tokens": 64, "temperature": 0}
SWITCH = "decode steps now run compiled"


@dataclass
class Run:
    kind: str
    first_answer_s: float
    answer: str
    compiled_s: float | None
    eager_ms_per_token: float
    compiled_ms_per_token: float | None


def _post(url: str, body: dict[str, object], timeout: float = 120) -> dict[str, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(json.load(r))


def _ms_per_token(base: str) -> float:
    """One 64-token greedy completion (ignore_eos: always 64 tokens), its time per generated token."""
    start = time.perf_counter()
    out = _post(base + "/completions", {"prompt": "1 + 2 =", "max_tokens": 64, "temperature": 0, "ignore_eos": True})
    usage = out["usage"]
    assert isinstance(usage, dict)
    return (time.perf_counter() - start) * 1000 / int(usage["completion_tokens"])


def one(kind: str, cache: Path, log: Path, eager: bool, timeout: float) -> Run:
    http = free_port()
    cmd = [sys.executable, "-m", "glm5_cli", "serve", "--http-port", str(http), "--grpc-port", str(free_port()),
           f"--worker-arg=--compile-cache-dir={cache}"]  # fmt: skip
    if eager:
        cmd.append("--worker-arg=--enforce-eager")
    base = f"http://127.0.0.1:{http}/v1"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        answer = ""
        while not answer:
            if proc.poll() is not None or time.monotonic() - start > timeout:
                raise RuntimeError(f"glm5 serve: no answer ({kind}); log tail:\n{log.read_text()[-2000:]}")
            try:
                reply = _post(base + "/chat/completions", QUESTION, timeout=60)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
                continue
            choices = reply["choices"]
            assert isinstance(choices, list)
            answer = str(choices[0]["message"]["content"] or "")
        first = time.monotonic() - start
        eager_speed = _ms_per_token(base)
        compiled_at, compiled_speed = None, None
        while not eager and compiled_at is None and time.monotonic() - start < timeout:
            if SWITCH in log.read_text():
                compiled_at = time.monotonic() - start
            time.sleep(0.5)
        if compiled_at is not None:
            _ms_per_token(base)  # the first compiled run of each graph shape pays its guard set-up
            compiled_speed = statistics.median(_ms_per_token(base) for _ in range(3))
        return Run(kind, first, answer, compiled_at, eager_speed, compiled_speed)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1, help="cold + warm pairs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take to compile")
    p.add_argument("--smoke", action="store_true", help="one eager start (no compile): checks the path only")
    a = p.parse_args()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="glm5-first-answer-") as tmp:
        for r in range(1 if a.smoke else a.rounds):
            cache = Path(tmp) / f"cache{r}"
            kinds = ["eager"] if a.smoke else ["cold", "warm"]
            for kind in kinds:
                run = one(kind, cache, Path(tmp) / f"{kind}{r}.log", a.smoke, a.timeout)
                print(f"  {kind}: first answer {run.first_answer_s:.1f} s ({run.answer.strip()[:40]!r}), "
                      f"compiled at {_fmt(run.compiled_s)} s", flush=True)  # fmt: skip
                runs.append(run)
    print(
        "\n| start | runs | first answer (s, median) | compiled steps active (s) | ms/token eager | ms/token compiled |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for kind in dict.fromkeys(r.kind for r in runs):
        rs = [r for r in runs if r.kind == kind]
        compiled = [r.compiled_s for r in rs if r.compiled_s is not None]
        speeds = [r.compiled_ms_per_token for r in rs if r.compiled_ms_per_token is not None]
        print(f"| {kind} | {len(rs)} | {statistics.median(r.first_answer_s for r in rs):.1f} | "
              f"{_fmt(statistics.median(compiled) if compiled else None)} | "
              f"{statistics.median(r.eager_ms_per_token for r in rs):.1f} | "
              f"{_fmt(statistics.median(speeds) if speeds else None)} |")  # fmt: skip
    assert runs and all("42" in r.answer for r in runs), [r.answer for r in runs]


if __name__ == "__main__":
    main()
