"""HCCL rank tables (hccl.json, Ascend format v1.0) from the device plugin's pod annotations.

The Ascend device plugin writes, on each pod it gives NPUs to, the annotation
`ascend.kubectl.kubernetes.io/ascend-910-configuration`:

    {"pod_name": "...", "server_id": "<node IP>", "devices": [{"device_id": "0", "device_ip": "..."}, ...]}

One model replica is one HCCL ring. Its table lists the replica's pods (servers) and their devices, and
gives rank ids in the ring order the spec asks for: ringOrder[i] is the index (in device_id order over the
replica's devices) of the device that gets rank i; the default is 0..N-1. The table stays "initializing"
until every pod of the replica has reported its devices, then becomes "completed".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ANNOTATION = "ascend.kubectl.kubernetes.io/ascend-910-configuration"


class RankTableError(ValueError):
    """A pod's annotation cannot be used; the message names the pod and the problem."""


@dataclass(frozen=True, slots=True)
class PodDevices:
    pod_name: str
    server_id: str
    container_ip: str
    devices: tuple[tuple[str, str], ...]  # (device_id, device_ip), sorted by device id


def parse_annotation(pod_name: str, pod_ip: str | None, raw: str | None, expected_devices: int) -> PodDevices | None:
    """The pod's devices, None while the device plugin has not annotated it yet (or it has no IP yet)."""
    if raw is None or not pod_ip:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RankTableError(f"pod {pod_name}: annotation {ANNOTATION} is not valid JSON ({exc.msg})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        raise RankTableError(f"pod {pod_name}: annotation {ANNOTATION} has no 'devices' list")
    server_id = data.get("server_id")
    if not isinstance(server_id, str) or not server_id:
        raise RankTableError(f"pod {pod_name}: annotation {ANNOTATION} has no server_id")
    devices = []
    for i, dev in enumerate(data["devices"]):
        if not isinstance(dev, dict) or not dev.get("device_ip") or dev.get("device_id") in (None, ""):
            raise RankTableError(f"pod {pod_name}: device #{i} in {ANNOTATION} lacks device_id or device_ip")
        devices.append((str(dev["device_id"]), str(dev["device_ip"])))
    if len(devices) != expected_devices:
        raise RankTableError(
            f"pod {pod_name}: the device plugin reports {len(devices)} devices but the replica expects "
            f"{expected_devices}"
        )
    if len({d for d, _ in devices}) != len(devices):
        raise RankTableError(f"pod {pod_name}: duplicate device_id in {ANNOTATION}")
    devices.sort(key=lambda d: (len(d[0]), d[0]))  # numeric order for numeric ids
    return PodDevices(pod_name, server_id, pod_ip, tuple(devices))


def build_rank_table(pods: list[PodDevices | None], ring_order: list[int] | None) -> dict[str, Any]:
    """The hccl.json of one replica; `pods` in pod order, None for pods that have not reported yet."""
    reported = [p for p in pods if p is not None]
    if len(reported) < len(pods) or not pods:
        return {"status": "initializing", "version": "1.0", "server_count": str(len(reported)), "server_list": []}
    flat = [(p, dev_id, dev_ip) for p in reported for dev_id, dev_ip in p.devices]
    order = ring_order if ring_order is not None else list(range(len(flat)))
    if sorted(order) != list(range(len(flat))):
        raise RankTableError(f"ring order {order} is not a permutation of the replica's {len(flat)} devices")
    rank_of = {device_index: rank for rank, device_index in enumerate(order)}
    servers: dict[str, dict[str, Any]] = {}
    for index, (pod, dev_id, dev_ip) in enumerate(flat):
        server = servers.setdefault(
            pod.pod_name, {"server_id": pod.server_id, "container_ip": pod.container_ip, "device": []}
        )
        server["device"].append({"device_id": dev_id, "device_ip": dev_ip, "rank_id": str(rank_of[index])})
    for server in servers.values():
        server["device"].sort(key=lambda d: int(d["rank_id"]))
    server_list = sorted(servers.values(), key=lambda s: min(int(d["rank_id"]) for d in s["device"]))
    return {"status": "completed", "version": "1.0", "server_count": str(len(server_list)), "server_list": server_list}
