"""HTTP/2 beside HTTP/1.1: Hypercorn serving the same ASGI app, in the same process and loop.

``sluice serve --http2`` opens a second listener (``--http2-port``) run by Hypercorn's
asyncio server: over TLS (``--ssl-certfile``, ``--ssl-keyfile``) it negotiates ``h2`` or
``http/1.1`` by ALPN; on a plain port it speaks HTTP/1.1 and HTTP/2 with prior knowledge
(h2c, the connection preface) and the h2c upgrade. Every endpoint works over both, through
the app's plain ASGI path (the SSE shell is
:func:`sluice.transports.sse.send_event_stream`); the HTTP/1.1 port keeps the native fast
path.

Why Hypercorn: it is the one maintained ASGI server with HTTP/2 that runs inside an event
loop it did not start, so the h2 listener shares the process's runtime (hub, logs,
engine) with uvicorn's HTTP/1.1 one; each HTTP/2 stream's flow control is its own (a
stream whose window is closed holds only its own ``send``), and it drops hop-by-hop
headers on h2. Granian and uvicorn would each have to own the process and its loop.

Bounds: :data:`MAX_CONCURRENT_STREAMS` per connection (SETTINGS_MAX_CONCURRENT_STREAMS),
the app's own limits on everything else; on stop, requests get :data:`STOP_GRACE_S`
(the hub ends its live streams first, so readers see their terminal events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast

from hypercorn.asyncio import serve
from hypercorn.config import Config
from hypercorn.typing import Framework

from sluice.errors import ConfigError
from sluice.transports.asgi import ASGIApp, Receive, Scope, Send

__all__ = [
    "MAX_CONCURRENT_STREAMS",
    "STOP_GRACE_S",
    "Http2Options",
    "check_tls",
    "serving_http2",
]

MAX_CONCURRENT_STREAMS: Final = 128
STOP_GRACE_S: Final = 1.0
# Hypercorn's default idle keep-alive, as the HTTP/1.1 port's (--keep-alive-timeout 5).
_KEEP_ALIVE_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class Http2Options:
    """Where the HTTP/2 listener is and whether it speaks TLS."""

    host: str
    port: int
    certfile: Path | None = None
    keyfile: Path | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"http2 port must be a TCP port (0-65535), got {self.port}")
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigError("--ssl-certfile and --ssl-keyfile go together")

    @property
    def tls(self) -> bool:
        return self.certfile is not None


class _WithoutLifespan:
    """The app for a second server: the first runs its lifespan (the runtime), so this
    one's lifespan messages are answered here and never reach the app."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self._app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


def _listening_socket(options: Http2Options) -> socket.socket:
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((options.host, options.port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot serve HTTP/2 on {options.host}:{options.port}: {exc}") from exc
    return sock


def _config(options: Http2Options) -> Config:
    """Hypercorn's configuration for ``options``, TLS checked (:class:`ConfigError`)."""
    config = Config()
    if options.tls:
        config.certfile = str(options.certfile)
        config.keyfile = str(options.keyfile)
        config.alpn_protocols = ["h2", "http/1.1"]
        try:
            config.create_ssl_context()  # a bad certificate or key fails here, not later
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot use the TLS certificate and key: {exc}") from exc
    return config


def check_tls(options: Http2Options) -> None:
    """Raise :class:`ConfigError` unless ``options``' certificate and key load."""
    _config(options)


@contextlib.asynccontextmanager
async def serving_http2(app: ASGIApp, options: Http2Options) -> AsyncIterator[int]:
    """Serve ``app`` over HTTP/2 (and HTTP/1.1) for the block; yields the bound port."""
    config = _config(options)
    sock = _listening_socket(options)  # bound here: the port is known, a clash is ours
    port: int = sock.getsockname()[1]
    config.bind = [f"fd://{sock.detach()}"]  # Hypercorn owns (and closes) the descriptor
    config.h2_max_concurrent_streams = MAX_CONCURRENT_STREAMS
    config.keep_alive_timeout = _KEEP_ALIVE_S
    config.graceful_timeout = STOP_GRACE_S
    config.accesslog = None
    config.errorlog = logging.getLogger(__name__)  # the process's logging, not a second handler
    config.include_server_header = False
    stop = asyncio.Event()
    # Hypercorn types scopes and messages as TypedDicts; the app takes the plain mappings.
    framework = cast(Framework, _WithoutLifespan(app))
    task = asyncio.create_task(serve(framework, config, shutdown_trigger=stop.wait))
    try:
        yield port
    finally:
        stop.set()
        await task
