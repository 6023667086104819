"""What every glm5 gRPC server does the same way: message limits, health checking, reflection, binding."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

MESSAGE_LIMIT = 64 << 20


def new_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    return grpc.aio.server(
        interceptors=list(interceptors),
        options=[("grpc.max_receive_message_length", MESSAGE_LIMIT), ("grpc.max_send_message_length", MESSAGE_LIMIT)],
    )


async def start_serving(
    server: grpc.aio.Server, service_name: str, add_service: Callable[[grpc.aio.Server], None], host: str, port: int
) -> tuple[HealthServicer, int]:
    """Adds the service, grpc.health.v1 and reflection, binds host:port (0: any free port), starts, and reports
    SERVING for "" and the service. Returns the health servicer (for graceful shutdown) and the bound port."""
    add_service(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((service_name, health_name, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    for name in ("", service_name):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return health, bound


async def resolve_service(target: str) -> set[str]:
    """host:port of a headless Service -> one host:port per A/AAAA record (IPv6 in brackets, as gRPC targets
    want them). Raises OSError when the name does not resolve; callers decide what to keep meanwhile."""
    host, _, port = target.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    return {f"[{s[0]}]:{port}" if family == socket.AF_INET6 else f"{s[0]}:{port}" for family, *_, s in infos}
