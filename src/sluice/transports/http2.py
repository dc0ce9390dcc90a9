"""HTTP/2 beside HTTP/1.1: our own listener, in the same process and loop.

``sluice serve --http2`` opens a second listener (``--http2-port``): over TLS
(``--ssl-certfile``, ``--ssl-keyfile``) it negotiates ``h2`` or ``http/1.1`` by ALPN (RFC
7301); on a plain port it reads a connection's first bytes and speaks HTTP/2 with prior
knowledge (h2c, RFC 9113 section 3.3) when they are the connection preface, HTTP/1.1
otherwise. Every endpoint works over both.

- HTTP/2 connections are :class:`~sluice.transports.http2_connection.H2Protocol`: our
  protocol over the sans-IO ``h2`` library, shaped like the native HTTP/1.1 path (the SSE
  reads and the compatible APIs' ``POST`` are answered by the opener's routes and written
  through the delivery core by callbacks; everything else runs the ASGI app).
- HTTP/1.1 connections on this port are the HTTP/1.1 port's own protocol
  (:func:`~sluice.transports.http1.uvicorn_adapter.protocol_class`, with its bounds,
  deadlines and native path), made by a uvicorn configuration of their own. WebSocket
  (``/v1/ws``) is served on the HTTP/1.1 port only; the h2c upgrade (``Upgrade: h2c``)
  is not offered (RFC 9113 deprecates it): a client that wants h2c uses prior knowledge.

Why our own: measured by ``bench/transports.py``, Hypercorn (the maintained ASGI server
with HTTP/2 that runs inside a loop it did not start, which served this port before) cost
2.5x the HTTP/1.1 native path's server CPU per token, most of it in the ASGI shell and its
per-stream send task; the issue's bound is 1.5x.

Bounds: :data:`~sluice.transports.http2_connection.MAX_CONCURRENT_STREAMS` per connection
(SETTINGS_MAX_CONCURRENT_STREAMS), the opener's limits on heads and bodies; a connection
that does not choose a protocol within the head timeout is closed, one with no stream for
``keep_alive_s`` gets GOAWAY. On stop, the listener closes, every connection gets GOAWAY
and its SSE streams end on an event boundary (the hub ends its live streams first, so
readers see their terminal events); requests get :data:`STOP_GRACE_S`, then are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast

import uvicorn
from uvicorn.server import ServerState

from sluice.errors import ConfigError
from sluice.transports.asgi import ASGIApp
from sluice.transports.http1.opener import Opener
from sluice.transports.http1.uvicorn_adapter import protocol_class
from sluice.transports.http2_connection import MAX_CONCURRENT_STREAMS, H2Protocol, H2Site

__all__ = [
    "MAX_CONCURRENT_STREAMS",
    "PREFACE",
    "STOP_GRACE_S",
    "Http2Options",
    "check_tls",
    "serving_http2",
]

STOP_GRACE_S: Final = 1.0
# The idle keep-alive, as the HTTP/1.1 port's (--keep-alive-timeout 5).
_KEEP_ALIVE_S: Final = 5.0
# RFC 9113 section 3.4: what an HTTP/2 client sends first.
PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_ALPN: Final = ["h2", "http/1.1"]


@dataclass(frozen=True, slots=True)
class Http2Options:
    """Where the HTTP/2 listener is, whether it speaks TLS, and whether the native path
    answers its SSE reads and compatible APIs (``--no-native-sse``: the ASGI app does)."""

    host: str
    port: int
    certfile: Path | None = None
    keyfile: Path | None = None
    native: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"http2 port must be a TCP port (0-65535), got {self.port}")
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigError("--ssl-certfile and --ssl-keyfile go together")

    @property
    def tls(self) -> bool:
        return self.certfile is not None


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


def _tls_context(options: Http2Options) -> ssl.SSLContext | None:
    """The server's TLS context (ALPN: h2, then http/1.1), or ``None`` for a plain port;
    a certificate or key that does not load is a :class:`ConfigError`."""
    if options.certfile is None or options.keyfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(options.certfile, options.keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot use the TLS certificate and key: {exc}") from exc
    context.set_alpn_protocols(_ALPN)
    return context


def check_tls(options: Http2Options) -> None:
    """Raise :class:`ConfigError` unless ``options``' certificate and key load."""
    _tls_context(options)


class _Listener:
    """The protocols of one listener: HTTP/2 connections, and the HTTP/1.1 port's own
    protocol for the others."""

    def __init__(self, app: ASGIApp, opener: Opener, options: Http2Options) -> None:
        self.h2 = H2Site(app, opener, native=options.native, keep_alive_s=_KEEP_ALIVE_S)
        config = uvicorn.Config(
            app,
            http=protocol_class(opener, native=options.native),
            ws="none",
            lifespan="off",
            # Neither touches logging: uvicorn configures the process's loggers when a
            # Config is made (access_log=False would remove the access log's handlers,
            # the HTTP/1.1 port's too); the access log follows the HTTP/1.1 port's.
            log_config=None,
            server_header=False,
            timeout_keep_alive=int(_KEEP_ALIVE_S),
        )
        config.load()
        self.http1_state = ServerState()
        protocol: Callable[..., asyncio.Protocol] = config.http_protocol_class
        self._http1 = functools.partial(
            protocol, config=config, server_state=self.http1_state, app_state={}
        )
        self.head_timeout_s = opener.limits.head_timeout_s

    def h2_protocol(self) -> asyncio.Protocol:
        return H2Protocol(self.h2)

    def http1_protocol(self) -> asyncio.Protocol:
        return self._http1()

    def __call__(self) -> asyncio.Protocol:
        return _FirstBytes(self)

    def shutdown(self) -> None:
        for h2_connection in list(self.h2.connections):
            h2_connection.shutdown()
        for http1_connection in list(self.http1_state.connections):
            http1_connection.shutdown()

    async def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the requests under way, then cancel the rest and
        close every connection."""
        tasks = self.h2.tasks | self.http1_state.tasks
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for task in self.h2.tasks | self.http1_state.tasks:
            task.cancel()
        for h2_connection in list(self.h2.connections):
            h2_connection.abort()
        for http1_connection in list(self.http1_state.connections):
            http1_connection.transport.abort()


class _FirstBytes(asyncio.Protocol):
    """A new connection, until it is known which protocol it speaks: by ALPN over TLS, by
    its first bytes on a plain port (the HTTP/2 preface, or anything else: HTTP/1.1).
    The chosen protocol then takes over the transport."""

    def __init__(self, listener: _Listener) -> None:
        self._listener = listener
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not its subclasses
        self._transport = transport
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:  # the TLS handshake is done: ALPN chose
            chosen = ssl_object.selected_alpn_protocol()
            listener = self._listener
            self._switch(listener.h2_protocol() if chosen == "h2" else listener.http1_protocol())
            return
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self._listener.head_timeout_s, transport.close)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data
        if len(buffer) < len(PREFACE) and PREFACE.startswith(buffer):
            self._buffer = buffer  # a prefix of the preface (or of nothing yet)
            return
        self._buffer = b""
        listener = self._listener
        is_h2 = buffer.startswith(PREFACE)
        self._switch(listener.h2_protocol() if is_h2 else listener.http1_protocol(), buffer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _switch(self, protocol: asyncio.Protocol, data: bytes = b"") -> None:
        self._stop_deadline()
        transport = self._transport
        assert transport is not None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if data and not transport.is_closing():
            protocol.data_received(data)


@contextlib.asynccontextmanager
async def serving_http2(app: ASGIApp, opener: Opener, options: Http2Options) -> AsyncIterator[int]:
    """Serve ``app`` (its native routes through ``opener``) over HTTP/2 and HTTP/1.1 for
    the block; yields the bound port."""
    context = _tls_context(options)
    sock = _listening_socket(options)  # bound here: the port is known, a clash is ours
    port: int = sock.getsockname()[1]
    listener = _Listener(app, opener, options)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        listener,
        sock=sock,
        ssl=context,
        ssl_handshake_timeout=opener.limits.head_timeout_s if context is not None else None,
    )
    try:
        yield port
    finally:
        server.close()
        listener.shutdown()
        await listener.wait(STOP_GRACE_S)
