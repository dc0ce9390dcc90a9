"""The gRPC front: a ``grpc.aio`` server beside the HTTP one, over the same runtime.

``sluice serve --grpc-port N`` runs it on the HTTP server's host, in the same process and
event loop, for the app's lifespan (:class:`~sluice.gateway.app.SluiceApp` enters it
after the runtime): ``sluice.v1.Streams`` (:mod:`sluice.grpc_api.service`), the standard
health service (``grpc.health.v1.Health``: ``SERVING`` for the whole server and for
``sluice.v1.Streams`` while it runs, ``NOT_SERVING`` once it begins to stop) and server
reflection (so ``grpcurl`` lists and calls it without the ``.proto``).

Limits: a request message is at most :data:`MAX_RECEIVE_BYTES` (a ``GenerateRequest``
is a prompt, bounded by ``--max-prompt-chars`` anyway); HTTP/2 keepalive pings every
:data:`KEEPALIVE_S` keep idle streams alive through proxies, the way SSE heartbeats do.
On stop, calls get :data:`STOP_GRACE_S` to end (the hub ends live streams with an error
event first, so readers see a terminal event) before they are cancelled.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Final

import grpc

from sluice.gateway.auth import Auth
from sluice.gateway.settings import Settings
from sluice.grpc_api import hosting
from sluice.grpc_api.service import SERVICE, StreamsService
from sluice.runtime import Runtime

__all__ = ["KEEPALIVE_S", "MAX_RECEIVE_BYTES", "STOP_GRACE_S", "serving"]

MAX_RECEIVE_BYTES: Final = 4 << 20
KEEPALIVE_S: Final = 15.0  # the SSE heartbeat's default interval
STOP_GRACE_S: Final = 1.0


@contextlib.asynccontextmanager
async def serving(
    runtime: Runtime, settings: Settings, auth: Auth, host: str, port: int
) -> AsyncIterator[int]:
    """Serve gRPC on ``host:port`` (0: a free port) for the block; yields the port."""
    server = grpc.aio.server(
        options=(
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.so_reuseport", 0),
        )
    )
    server.add_generic_rpc_handlers((StreamsService(runtime, settings, auth).handler(),))
    bound, health_servicer = await hosting.start(server, SERVICE, host, port)
    try:
        yield bound
    finally:
        await health_servicer.enter_graceful_shutdown()
        await server.stop(STOP_GRACE_S)
