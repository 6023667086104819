"""The process groups of one model replica, and the channel rank 0 drives the other ranks with.

Three groups over the same ranks:
- world (gloo): the rendezvous and the waits that may legitimately take long (ranks loading their shards at
  start-up or a new checkpoint), bounded by --startup-timeout;
- control (gloo): rank 0's per-step messages to the followers, bounded by --collective-timeout; an idle rank 0
  sends a heartbeat so a follower's wait never reaches it;
- device (nccl on CUDA, hccl on Ascend; the control group on CPU): the model's collectives, bounded by
  --collective-timeout.
A collective that fails or times out raises; the replica then stops as a whole (ReplicaFailure), never hangs.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from glm5.errors import ConfigError, Glm5Error
from glm5.parallel import TensorParallel

from glm5_worker.config import EngineConfig

log = logging.getLogger(__name__)
DEVICE_BACKEND = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
RANK_TABLE_POLL_S = 5.0


class ReplicaFailure(Glm5Error):
    """A rank of the replica died, hung past the collective timeout or failed a step: the replica cannot serve."""


@dataclass(slots=True)
class Replica:
    tp: TensorParallel
    channel: Channel
    config: EngineConfig
    device: torch.device  # this rank's device

    def wait_all(self, what: str) -> None:
        """Waits (up to --startup-timeout) for every rank to get here, e.g. done loading its shard."""
        start = time.monotonic()
        try:
            dist.barrier(group=self.channel.world)
        except Exception as exc:
            raise ReplicaFailure(f"rank {self.tp.rank}: ranks did not all finish {what}: {exc}") from exc
        log.debug("rank %d waited %.1fs for the others to finish %s", self.tp.rank, time.monotonic() - start, what)

    def agreed_kv_bytes(self, budget: Callable[[], int]) -> int:
        """Once every rank has loaded its shard, the smallest KV budget of any rank: every rank's pool must be
        the same size (same blocks, same slots)."""
        self.wait_all("loading their shards")
        return self.channel.agree_min(budget())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class Channel:
    """Messages from rank 0 to every other rank: any picklable object, in the order sent."""

    def __init__(self, world: Any, control: Any) -> None:
        self.world = world
        self.control = control

    def send(self, message: Any) -> None:
        dist.broadcast_object_list([message], group=self.control, group_src=0)

    def recv(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, group=self.control, group_src=0)
        return box[0]

    def gather(self, item: Any, long: bool = False) -> list[Any]:
        """Every rank's `item`, on every rank (`long`: allowed up to --startup-timeout)."""
        out: list[Any] = [None] * dist.get_world_size(self.control)
        dist.all_gather_object(out, item, group=self.world if long else self.control)
        return out

    def agree_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


def rendezvous(config: EngineConfig, rank: int, port: int, listener: socket.socket | None = None) -> Any:
    """The replica's TCP store. Rank 0 hosts it (on `listener` when given: a loopback socket for a replica on
    one host, since the store itself would listen on every interface); the others connect, retrying until
    --startup-timeout."""
    return torch._C._distributed_c10d.TCPStore(
        config.master_addr, port, config.tensor_parallel_size, is_master=rank == 0,
        timeout=datetime.timedelta(seconds=config.startup_timeout_s), wait_for_workers=False,
        master_listen_fd=listener.fileno() if listener is not None else None,
    )  # fmt: skip


def loopback_only(config: EngineConfig) -> bool:
    """A replica on one host keeps its rendezvous and its gloo traffic on the loopback interface."""
    return config.nnodes == 1


def use_loopback_for_gloo() -> None:
    """gloo picks an interface from the host name, which in a pod is its cluster address: on one host, the
    replica's tensors have no business there (set before any process group exists; spawned ranks inherit it)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def wait_for_ranks(store: Any, world_size: int, timeout_s: float, check: Callable[[], None]) -> None:
    """Rank 0, before it joins the groups: waits until every other rank is ready to join, calling `check`
    between polls (it raises if a rank this host started has died: no point in waiting out the timeout)."""
    keys = [f"ready/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    last_log = 0.0
    while not store.check(keys):
        check()
        now = time.monotonic()
        if now > deadline:
            missing = [k.removeprefix("ready/") for k in keys if not store.check([k])]
            raise ReplicaFailure(f"ranks {', '.join(missing)} did not start within {timeout_s:.0f}s")
        if now - last_log > 30:
            log.info("waiting for %d other ranks to start", len(keys))
            last_log = now
        time.sleep(0.1)


def join(config: EngineConfig, rank: int, device: torch.device, store: Any) -> Replica:
    """Joins the replica's process groups as `rank` on `device`. On Ascend with a rank table, the device is the
    one the table gives this rank."""
    n = config.tensor_parallel_size
    startup = datetime.timedelta(seconds=config.startup_timeout_s)
    collective = datetime.timedelta(seconds=config.collective_timeout_s)
    if device.type == "npu":
        table = prepare_rank_table(config.startup_timeout_s)
        if table is not None:
            device = torch.device("npu", npu_index_of_rank(table, rank, n))
    if rank > 0:
        store.set(f"ready/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=startup)
    control = dist.new_group(backend="gloo", timeout=collective)
    backend = DEVICE_BACKEND[device.type]
    if backend == "gloo":
        device_group = control
    else:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.npu.set_device(device)  # type: ignore[attr-defined]
        device_group = dist.new_group(backend=backend, timeout=collective)
    tp = TensorParallel(rank, n, config.is_expert_parallel, device_group, reduce_by_gather=backend == "gloo")
    log.info("rank %d/%d joined (%s on %s, control over gloo)", rank, n, backend, device)
    return Replica(tp, Channel(dist.group.WORLD, control), config, device)


def prepare_rank_table(timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """For HCCL's rank-table mode (torch_npu builds the communicator from RANK_TABLE_FILE): waits until the
    operator's table for this replica is complete and, with POD_IP set, lists this pod (a pod replaced under the
    same name, with a new address, would otherwise read its predecessor's table, complete until the operator
    rewrites it), then points RANK_TABLE_FILE at a regular-file copy of it (torch_npu refuses a symbolic link, and
    every file of a ConfigMap volume is one). Returns the table, or None without RANK_TABLE_FILE (HCCL then
    negotiates its own ring)."""
    env = env if env is not None else os.environ  # type: ignore[assignment]
    assert env is not None
    source = env.get("RANK_TABLE_FILE")
    if not source:
        return None
    deadline = time.monotonic() + timeout_s
    own_ip = env.get("POD_IP")
    while True:
        status = _rank_table_status(Path(source), own_ip)
        if status == "completed":
            break
        if time.monotonic() > deadline:
            raise ConfigError(f"rank table {source} is still {status!r} after {timeout_s:.0f}s")
        log.info("waiting for the operator to complete rank table %s (status: %s)", source, status)
        time.sleep(RANK_TABLE_POLL_S)
    copy = Path(tempfile.gettempdir()) / f"glm5-hccl-{os.getpid()}.json"
    shutil.copyfile(Path(source).resolve(), copy)
    env["RANK_TABLE_FILE"] = str(copy)
    table: dict[str, Any] = json.loads(copy.read_text())
    return table


def npu_index_of_rank(table: dict[str, Any], rank: int, world_size: int) -> int:
    """The local NPU index of `rank`: its device's position among its server's devices in device_id order (the
    order the operator and the device plugin list them in, and the order ASCEND_RT_VISIBLE_DEVICES makes them
    visible in). With a ring order, rank r need not sit on device r."""
    servers = table.get("server_list") or []
    ranks = [int(d["rank_id"]) for s in servers for d in s.get("device", [])]
    if sorted(ranks) != list(range(world_size)):
        raise ConfigError(
            f"rank table lists ranks {sorted(ranks)} but --tensor-parallel-size is {world_size}; "
            "devicesPerReplica and the table must agree"
        )
    for server in servers:
        devices = sorted(server["device"], key=lambda d: int(d["device_id"]))
        for index, dev in enumerate(devices):
            if int(dev["rank_id"]) == rank:
                return index
    raise AssertionError("unreachable: every rank was listed")


def _rank_table_status(path: Path, own_ip: str | None = None) -> str:
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        return "missing"
    except (OSError, json.JSONDecodeError):
        return "unreadable"
    if not isinstance(table, dict):
        return "unreadable"
    status = str(table.get("status", "unknown"))
    servers = table.get("server_list") or []
    if status == "completed" and own_ip and all(s.get("container_ip") != own_ip for s in servers):
        return f"completed without this pod ({own_ip}): a predecessor's"
    return status


def rank_of(config: EngineConfig, local_rank: int) -> int:
    return config.node_rank * config.ranks_per_node + local_rank


def local_ranks(config: EngineConfig) -> Sequence[int]:
    return range(config.ranks_per_node)
