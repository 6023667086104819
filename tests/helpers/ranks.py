"""Runs a function on N local ranks (real processes, torch.distributed over gloo) and collects what each returns."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: Any, backend: str
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        # plain pickle bytes: torch.multiprocessing would share tensors through this process's memory, gone once
        # it exits
        out.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240.0, backend: str = "gloo"
) -> list[Any]:
    """fn(rank, world, *args) on `world` processes (nccl: rank r on cuda:r); returns the results in rank order,
    raises on any failure."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, out, backend), daemon=True) for r in range(world)
    ]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = out.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
