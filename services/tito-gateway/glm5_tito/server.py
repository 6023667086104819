"""The TITO gateway's gRPC server: the Gateway servicer behind health, reflection and the connection limits."""

from __future__ import annotations

import logging

import grpc
from glm5.rl.buffer import RolloutBuffer
from glm5.serving import new_server, start_serving
from glm5.v1 import tito_pb2, tito_pb2_grpc

from glm5_tito.gateway import Gateway, GatewayConfig

log = logging.getLogger(__name__)
SERVICE_NAME = tito_pb2.DESCRIPTOR.services_by_name["TitoGateway"].full_name


async def start_gateway(
    config: GatewayConfig, buffer: RolloutBuffer, host: str, port: int
) -> tuple[grpc.aio.Server, Gateway, int]:
    gateway = Gateway(config, buffer)
    await gateway.start()
    server = new_server(limits=config.connections)

    def add(s: grpc.aio.Server) -> None:
        tito_pb2_grpc.add_TitoGatewayServicer_to_server(gateway, s)  # type: ignore[no-untyped-call]

    _, bound = await start_serving(server, SERVICE_NAME, add, host, port, config.tls)
    log.info("TITO gateway on %s:%d over %s", host, bound, list(config.engines))
    return server, gateway, bound
