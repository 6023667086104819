"""Reconcile time of the real kopf operator against the kmock API emulator: from `create` of a
GLM5Deployment to all of its children existing (and its first status written).

    python -m benchmarks.operator_reconcile [--count 50] [--repeats 3]
    python -m benchmarks.operator_reconcile --smoke       # 3 resources, one repeat: the table in seconds

Baseline in the same process: one resource on its own. Then `count` resources created back to back (what
`kubectl apply -f dir/` does): per-resource latency (create -> last child) and the amortised wall time per
resource (total / count), the number the issue's target (<= 0.2 s per resource) is about. Also API
requests per resource. Medians over repeats; the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from glm5_operator.api import API_VERSION
from glm5_operator.config import OperatorConfig
from glm5_operator.kube import Kube

from tests.helpers.kube import OperatorThread, VersionedEmulator, emulated_cluster

CHILDREN = [
    ("v1/configmaps", "engine"),
    ("v1/services", "worker"),
    ("apps/v1/statefulsets", "worker"),
    ("policy/v1/poddisruptionbudgets", "worker"),
    ("v1/configmaps", "router-config"),
    ("apps/v1/deployments", "router"),
    ("v1/services", "router"),
]


def _done(emulator: VersionedEmulator, name: str) -> bool:
    try:
        if any(emulator.objects[res, "default", f"{name}-{suffix}"].deleted for res, suffix in CHILDREN):
            return False
        status = emulator.objects["glm5.ai/v1alpha1/glm5deployments", "default", name].raw.get("status") or {}
        return bool(status.get("conditions"))
    except KeyError:
        return False


async def run_batch(emulator: VersionedEmulator, kube: Kube, prefix: str, count: int) -> dict[str, Any]:
    names = [f"{prefix}-{i}" for i in range(count)]
    created: dict[str, float] = {}
    finished: dict[str, float] = {}
    served_before = emulator.served

    async def create(name: str) -> None:
        body = {"apiVersion": API_VERSION, "kind": "GLM5Deployment",
                "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
                "spec": {"model": {"path": "/models/tiny"}, "workers": {"replicas": 2}}}  # fmt: skip
        created[name] = time.perf_counter()
        await asyncio.to_thread(kube.create, body)

    start = time.perf_counter()
    creating = asyncio.gather(*(create(n) for n in names))
    while len(finished) < count:
        now = time.perf_counter()
        for name in names:
            if name not in finished and name in created and _done(emulator, name):
                finished[name] = now
        if now - start > 600:
            raise TimeoutError(f"only {len(finished)}/{count} reconciled after 600 s")
        await asyncio.sleep(0.005)
    await creating
    wall = max(finished.values()) - start
    latencies = sorted(finished[n] - created[n] for n in names)
    requests = emulator.served - served_before
    return {
        "count": count,
        "wall_s": wall,
        "per_resource_s": wall / count,
        "p50_s": statistics.median(latencies),
        "p95_s": latencies[min(count - 1, int(0.95 * count))],
        "max_s": latencies[-1],
        "requests_per_resource": requests / count,
    }


async def main(count: int, repeats: int, smoke: bool = False) -> None:
    rows: list[tuple[str, dict[str, Any]]] = []
    async with emulated_cluster(request_log=24) as emulator:
        server = str(emulator.url).rstrip("/")
        kube = Kube.for_server(server)
        operator = await OperatorThread.start(OperatorConfig(), server)
        try:
            for r in range(repeats):
                rows.append(("single", await run_batch(emulator, kube, f"one{r}", 1)))
                rows.append((f"batch of {count}", await run_batch(emulator, kube, f"many{r}", count)))
        finally:
            await operator.stop()

    print(f"{'run':<14}{'wall s':>9}{'s/resource':>12}{'p50 s':>9}{'p95 s':>9}{'max s':>9}{'API req/res':>13}")
    for label, row in rows:
        print(f"{label:<14}{row['wall_s']:9.3f}{row['per_resource_s']:12.3f}{row['p50_s']:9.3f}{row['p95_s']:9.3f}"
              f"{row['max_s']:9.3f}{row['requests_per_resource']:13.1f}")  # fmt: skip
    single = statistics.median(r["per_resource_s"] for label, r in rows if label == "single")
    batch = statistics.median(r["per_resource_s"] for label, r in rows if label != "single")
    p50 = statistics.median(r["p50_s"] for label, r in rows if label != "single")
    print(f"\nmedian over {repeats} repeats: single {single:.3f} s; batch of {count}: {batch:.3f} s per resource "
          f"(amortised), p50 latency {p50:.3f} s; batch/single per resource = {batch / single:.2f}x")  # fmt: skip
    if smoke:  # the table, not the speed: every resource got all its children and a status
        assert len(rows) == 2 * repeats and all(r["requests_per_resource"] > 0 for _, r in rows), rows
        print("smoke: ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="3 resources, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.count, args.repeats = 3, 1
    asyncio.run(main(args.count, args.repeats, args.smoke))
