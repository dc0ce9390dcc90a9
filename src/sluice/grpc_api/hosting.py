"""What every gRPC server of Sluice does around its service (``sluice serve --grpc-port``
and ``sluice worker``): the standard health service, server reflection, the bind with a
clear error, and ``SERVING`` once it runs."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sluice.errors import ConfigError

__all__ = ["start"]


async def start(
    server: grpc.aio.Server, service: str, host: str, port: int
) -> tuple[int, health.aio.HealthServicer]:
    """Add health and reflection to ``server`` (its ``service``'s handlers already added),
    bind it to ``host:port`` (0: a free port) and start it; the bound port, and the health
    servicer to call ``enter_graceful_shutdown`` on before stopping. Raises
    :class:`~sluice.errors.ConfigError` for an address it cannot bind."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (service, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"cannot serve gRPC on {address}: {exc}") from exc
    if not bound:
        raise ConfigError(f"cannot serve gRPC on {address}")
    await server.start()
    for name in ("", service):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return bound, health_servicer
