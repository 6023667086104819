from __future__ import annotations

import json

import pytest
from glm5_operator.ranktable import ANNOTATION, RankTableError, build_rank_table, parse_annotation


def annotation(server: str, n: int, base: int = 0) -> str:
    devices = [{"device_id": str(i), "device_ip": f"192.168.{base}.{i}"} for i in range(n)]
    return json.dumps({"pod_name": "p", "server_id": server, "devices": devices})


def test_initializing_until_every_pod_reports_then_completed_in_ring_order() -> None:
    pod = parse_annotation("w-0", "10.1.0.5", annotation("10.0.0.1", 4), 4)
    assert build_rank_table([None], None)["status"] == "initializing"
    table = build_rank_table([pod], [0, 2, 3, 1])
    assert table["status"] == "completed" and table["version"] == "1.0" and table["server_count"] == "1"
    server = table["server_list"][0]
    assert server["server_id"] == "10.0.0.1" and server["container_ip"] == "10.1.0.5"
    # rank i goes to the device at ringOrder[i]
    assert [(d["rank_id"], d["device_id"]) for d in server["device"]] == [
        ("0", "0"),
        ("1", "2"),
        ("2", "3"),
        ("3", "1"),
    ]


def test_two_servers_one_ring() -> None:
    a = parse_annotation("w-0", "10.1.0.5", annotation("10.0.0.1", 2, 1), 2)
    b = parse_annotation("w-1", "10.1.0.6", annotation("10.0.0.2", 2, 2), 2)
    table = build_rank_table([a, b], None)
    assert table["server_count"] == "2"
    assert [d["rank_id"] for s in table["server_list"] for d in s["device"]] == ["0", "1", "2", "3"]


@pytest.mark.parametrize(
    ("raw", "expected", "message"),
    [
        ("{not json", 2, "not valid JSON"),
        (json.dumps({"server_id": "1.2.3.4"}), 2, "no 'devices' list"),
        (json.dumps({"devices": []}), 0, "no server_id"),
        (json.dumps({"server_id": "s", "devices": [{"device_id": "0"}]}), 1, "lacks device_id or device_ip"),
        (annotation("s", 3), 4, "reports 3 devices but the replica expects 4"),
    ],
)
def test_bad_annotations_are_clear_errors(raw: str, expected: int, message: str) -> None:
    with pytest.raises(RankTableError, match=message) as err:
        parse_annotation("w-0", "10.1.0.5", raw, expected)
    assert "w-0" in str(err.value) and (ANNOTATION in str(err.value) or "devices" in str(err.value))


def test_pods_without_annotation_or_ip_are_pending() -> None:
    assert parse_annotation("w-0", None, annotation("s", 1), 1) is None
    assert parse_annotation("w-0", "10.1.0.5", None, 1) is None
