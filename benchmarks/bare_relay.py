"""The floor of a Python grpc.aio relay: glm5.v1.Router/Generate forwarded to Worker/Generate with nothing in
between (no queue, picking, parsing, telemetry or retries; one protobuf wrap per message).

`python -m benchmarks.router latency|throughput` runs it beside the router, so the figures separate what one
more grpc.aio hop costs on the machine from what the router's own work adds.

    python -m benchmarks.bare_relay --port 50999 --worker 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import grpc
from glm5.serving import new_server, start_serving
from glm5.v1 import router_pb2, router_pb2_grpc, worker_pb2_grpc


class BareRelay(router_pb2_grpc.RouterServicer):  # type: ignore[misc]
    def __init__(self, worker: str) -> None:
        self.stub = worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(worker))

    async def Generate(
        self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        async for resp in self.stub.Generate(request.request):
            yield router_pb2.RouterGenerateResponse(response=resp)


async def main(port: int, worker: str) -> None:
    server = new_server()
    relay = BareRelay(worker)
    name = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    await start_serving(server, name, lambda s: router_pb2_grpc.add_RouterServicer_to_server(relay, s),
                        "127.0.0.1", port)  # fmt: skip
    await server.wait_for_termination()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--worker", required=True)
    a = ap.parse_args()
    asyncio.run(main(a.port, a.worker))
