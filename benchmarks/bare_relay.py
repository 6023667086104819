"""The floor of a Python grpc.aio relay: glm5.v1.Router/Generate forwarded to Worker/Generate with nothing in
between (no queue, picking, parsing, telemetry or retries; one protobuf wrap per message).

`python -m benchmarks.router latency|throughput` runs it beside the router, so the figures separate what one
more grpc.aio hop costs on the machine from what the router's own work adds.

    python -m benchmarks.bare_relay --port 50999 --worker 127.0.0.1:50051
    python -m benchmarks.bare_relay --smoke      # relays one request from a scripted worker, then exits
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import grpc
from glm5.serving import new_server, start_serving
from glm5.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc


class BareRelay(router_pb2_grpc.RouterServicer):
    def __init__(self, worker: str) -> None:
        self.stub = worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(worker))  # type: ignore[no-untyped-call]

    async def Generate(
        self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        async for resp in self.stub.Generate(request.request):
            yield router_pb2.RouterGenerateResponse(response=resp)


async def serve(port: int, worker: str) -> grpc.aio.Server:
    server = new_server()
    relay = BareRelay(worker)
    name = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    add = router_pb2_grpc.add_RouterServicer_to_server
    await start_serving(server, name, lambda s: add(relay, s), "127.0.0.1", port)  # type: ignore[no-untyped-call]
    return server


async def main(port: int, worker: str) -> None:
    server = await serve(port, worker)
    await server.wait_for_termination()


async def smoke() -> None:
    """One request through the relay from the scripted worker: every token arrives."""
    from glm5.client import sampling

    from tests.helpers.procs import free_port, start_scripted_worker, stop

    proc, worker = start_scripted_worker()
    try:
        port = free_port()
        server = await serve(port, worker)
        request = router_pb2.RouterGenerateRequest(request=worker_pb2.GenerateRequest(
            prompt_token_ids=list(range(10, 26)), sampling=sampling(max_new_tokens=16)))  # fmt: skip
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)  # type: ignore[no-untyped-call]
            tokens = [t async for r in stub.Generate(request) for t in r.response.token_ids]
        await server.stop(1)
    finally:
        stop(proc)
    assert len(tokens) == 16, tokens
    print(f"relayed {len(tokens)} tokens from the scripted worker\nsmoke: ok")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--worker")
    ap.add_argument("--smoke", action="store_true", help="relay one request from a scripted worker, then exit")
    a = ap.parse_args()
    if a.smoke:
        asyncio.run(smoke())
    elif a.port is None or a.worker is None:
        ap.error("--port and --worker are required (or --smoke)")
    else:
        asyncio.run(main(a.port, a.worker))
