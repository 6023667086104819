"""Process-wide gRPC settings that must be in place before grpc is imported (grpc reads them then)."""

from __future__ import annotations

import os

# grpcio 1.80+ does Python's socket I/O on EventEngine threads, and every message read or written then hops from
# one of them to the completion queue's poller thread. The iomgr (epoll1) path, the default up to 1.79 and still
# built in, does the I/O on the poller thread itself: 20-30% less router CPU per streamed token
# (`python -m benchmarks.router stream`, docs/benchmarks.md n), CPU that a decode step on a small host would
# otherwise lose. Apache Beam turns the EventEngine client off as well (grpc/grpc#39113). grpc means to drop these
# experiments once the EventEngine rollout has settled: a grpcio without them ignores the variable.
IOMGR_EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"


def default_grpc_experiments() -> None:
    """GRPC_EXPERIMENTS = IOMGR_EXPERIMENTS unless the user set it (even empty: grpc's own defaults)."""
    os.environ.setdefault("GRPC_EXPERIMENTS", IOMGR_EXPERIMENTS)
