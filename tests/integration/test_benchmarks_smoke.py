"""Every benchmark runs in its smoke mode (issue 40): the smallest settings that still take its whole path, one
case per script, each with its own time limit, so a benchmark that a product change broke fails here, named.

A smoke run asserts that it printed its tables (never a speed) and exits 0; here its table's heading is looked for
too. The benchmarks run as their docs run them (`python benchmarks/X.py` or `python -m benchmarks.X`, from the
repository root) without the suite's GLM5_ENFORCE_EAGER: a smoke mode has to be quick on its own. Scripts under
benchmarks/ whose names start with `_` are helpers, not benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Benchmark:
    name: str  # benchmarks/NAME.py
    module: bool  # run as `python -m benchmarks.NAME` (as documented), else `python benchmarks/NAME.py`
    timeout_s: int  # ~3-5x its smoke time on a busy 2-core machine
    table: str  # a heading of the table it prints
    extra: tuple[str, ...] = ()

    @property
    def argv(self) -> list[str]:
        run = ["-m", f"benchmarks.{self.name}"] if self.module else [f"benchmarks/{self.name}.py"]
        return [sys.executable, *run, "--smoke", *self.extra]


BENCHMARKS = [
    Benchmark("agentic_eval", False, 120, "| model | set | problems | accuracy |"),
    Benchmark("bare_relay", True, 60, "relayed 16 tokens"),
    Benchmark("breaker_soak", False, 120, "signal                     threshold"),
    Benchmark("data_plane", False, 90, "| streams | output tok/s | worker loop |"),
    Benchmark("decode_attention", False, 60, "dense/sparse"),
    Benchmark("decode_latency", False, 180, "| server | run | output tok/s |"),
    Benchmark("engine_throughput", False, 120, "transformers tok/s"),
    Benchmark("first_answer", False, 120, "| start | runs | first answer (s, median) |"),
    Benchmark("kv_tiers", False, 120, "argmax changed"),
    Benchmark("operator_reconcile", True, 90, "API req/res"),
    Benchmark("quantized", False, 120, "w4a16 (bf16, int4 kernel)"),
    Benchmark("rl_loop", True, 180, "| loop | wall time (s) |"),
    Benchmark("rl_scale", True, 120, "| transport | seconds | GB/s | vs collective |"),
    Benchmark("router", True, 180, "fixed 100 ms window"),
    Benchmark("routing", False, 120, "| routing | hit rate | ideal | vs ideal |"),
    Benchmark("scaling_plan", False, 30, "int4-experts"),
    Benchmark("speculative", False, 60, "| method | k | ms/token | vs off |"),
    Benchmark("tensor_parallel", False, 120, "collectives ms"),
    Benchmark("tito_routing", True, 30, "bounded-load ring (gateway)"),
]
# the GPU path of the benchmarks that have one, where there is a GPU (skipped, and shown as skipped, elsewhere)
GPU = [Benchmark("decode_attention", False, 120, "dense/sparse", ("--device", "cuda", "--kernels", "triton"))]


def test_every_benchmark_has_a_smoke_case() -> None:
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts == {b.name for b in BENCHMARKS}, "a benchmark without a smoke case here (or a case without one)"


def run_smoke(bench: Benchmark) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLM5_ENFORCE_EAGER"}
    # its own process group: a benchmark's workers, routers and ranks go down with it whatever happens
    proc = subprocess.Popen(bench.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=bench.timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"benchmarks/{bench.name}.py --smoke did not finish in {bench.timeout_s} s; its output ends:\n"
                    f"{_tail(out)}")  # fmt: skip
    finally:
        _kill_group(proc.pid, signal.SIGKILL)  # anything it left behind
    text = out.decode(errors="replace")
    took = time.monotonic() - start
    assert proc.returncode == 0, (f"benchmarks/{bench.name}.py --smoke failed (exit {proc.returncode}, {took:.0f} s); "
                                  f"its output ends:\n{_tail(out)}")  # fmt: skip
    assert bench.table in text, (
        f"benchmarks/{bench.name}.py --smoke exited 0 without its table ({bench.table!r}):\n{_tail(out)}"
    )
    print(f"benchmarks/{bench.name}.py --smoke: {took:.1f} s")


@pytest.mark.parametrize(
    "bench", [pytest.param(b, id=b.name, marks=pytest.mark.timeout(b.timeout_s + 60)) for b in BENCHMARKS]
)
def test_smoke(bench: Benchmark) -> None:
    run_smoke(bench)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (the CPU path runs in test_smoke)")
@pytest.mark.parametrize(
    "bench", [pytest.param(b, id=f"{b.name}-cuda", marks=pytest.mark.timeout(b.timeout_s + 60)) for b in GPU]
)
def test_smoke_on_gpu(bench: Benchmark) -> None:
    run_smoke(bench)


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # nothing left in it
        os.killpg(pgid, sig)


def _tail(out: bytes | None, lines: int = 40) -> str:
    return "\n".join((out or b"").decode(errors="replace").splitlines()[-lines:])
