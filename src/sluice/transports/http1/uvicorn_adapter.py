"""uvicorn, adapted: the one module of Sluice that touches uvicorn's internals.

uvicorn takes its HTTP protocol as a class (``uvicorn.Config(http=...)``). The class
:func:`protocol_class` makes is uvicorn's httptools protocol with our connection logic
(:mod:`sluice.transports.http1.protocol`) wired into its parser callbacks:

- a request the application's :class:`~sluice.transports.http1.opener.Opener` routes to
  the native path (the SSE reads, the compatible APIs' ``POST``, under ``--native-sse``)
  is not run as an ASGI task: a :class:`~sluice.transports.http1.protocol.NativeExchange`
  collects its body and writes its answer to the transport (SSE through the delivery
  core, driven by callbacks). Everything else goes through the ASGI app unchanged;
- request heads are bounded while they are parsed (``HeadMeter``): a target over the
  limit is answered 414, header lines over it 431, and the connection closed;
- requests are bounded in time (:mod:`sluice.transports.http1.deadline`): a head must
  arrive within ``head_timeout_s`` of the connection (or, kept alive, of its first byte),
  a body within ``body_timeout_s`` of its head; past that the request is answered ``408``
  where no response is under way, and the connection closed (a connection that never
  sent a byte is just closed);
- uvicorn's ``limit_concurrency`` (``sluice serve --max-connections``) counts the
  connections *inside a request* (its head received, its response not yet complete; an
  SSE stream for its whole life), not idle or half-sent ones, which the deadlines close:
  a request that would make one more is refused like a full server (the opener's answer:
  ``503`` + ``Retry-After``, a ``retry:`` hint for an SSE read) and its connection closed;
- pipelining: a request pipelined behind a native answer is not served (it would wait for
  the end of a stream that may last hours); the native answer is delivered whole, with
  ``connection: close`` where its head is still to be written, then the connection is
  closed, and the client retries the unanswered request on a new one (RFC 9112 section
  9.3.2). Requests pipelined behind ASGI responses are queued and served in order, as
  uvicorn does. An ``Upgrade`` this server does not speak (WebSocket, ``ws="none"``) is
  answered as a plain request, then the connection is closed, since what follows on it is
  not HTTP/1.1;
- every close after a refusal or a deadline is a lingering close: the write side is shut
  first and what the client still sends is read and dropped for a moment, so its kernel
  does not answer the unread bytes with a reset that destroys the response (a 431 to a
  200 KB head arrives);
- with uvicorn's access log on, native answers are logged as uvicorn logs the others
  (``uvicorn.access``, the path percent-quoted).

What this module relies on is listed in :data:`RELIED_ON` and pinned by
``tests/transports/test_uvicorn_adapter.py``: a uvicorn release that renames or reshapes
any of it fails those tests, not a user's streams.
"""

from __future__ import annotations

import asyncio
import signal
import urllib.parse
from types import FrameType
from typing import Any, ClassVar, cast

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import ClientDisconnected, get_client_addr
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState
from websockets.http11 import Request
from websockets.protocol import State

from sluice.transports.answer import Whole
from sluice.transports.asgi import Scope
from sluice.transports.http1.deadline import ReadDeadline, ReadPhase
from sluice.transports.http1.opener import Opener, Refusal
from sluice.transports.http1.protocol import BusyConnections, HeadMeter, NativeExchange
from sluice.transports.http1.writer import response_head
from sluice.transports.websocket import SEND_TEXTS
from sluice.transports.websocket_protocol import server_text_frame

__all__ = [
    "RELIED_ON",
    "SluiceHttpProtocol",
    "SluiceWebSocketProtocol",
    "exit_without_reraise",
    "protocol_class",
]

# Lingering close (as Apache's and nginx's): after the response, the write side is shut
# and what the client still sends is dropped for this long (nginx: lingering_time) or this
# many bytes, then the socket is closed. Closing at once with unread bytes makes the kernel
# send a reset, which can destroy the response in flight.
_LINGER_S = 2.0
_MAX_DISCARD_BYTES = 1024 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

RELIED_ON: dict[str, tuple[str, ...]] = {
    # HttpToolsProtocol's methods we override or call, and its per-connection attributes.
    "HttpToolsProtocol": (
        "__init__",
        "connection_made",
        "connection_lost",
        "data_received",
        "on_message_begin",
        "on_url",
        "on_header",
        "on_headers_complete",
        "on_body",
        "on_message_complete",
        "on_response_complete",
        "shutdown",
        "pause_writing",
        "resume_writing",
        "_should_upgrade",
    ),
    "HttpToolsProtocol instance": (
        "config",
        "loop",
        "parser",
        "transport",
        "flow",
        "pipeline",
        "cycle",
        "scope",
        "headers",
        "url",
        "tasks",
        "server_state",
        "access_log",
        "access_logger",
        "limit_concurrency",
        "expect_100_continue",
    ),
    # The request cycle of an ASGI request, read and steered from the callbacks.
    "RequestResponseCycle instance": (
        "keep_alive",
        "response_started",
        "response_complete",
        "disconnected",
        "message_event",
    ),
    "FlowControl": ("read_paused", "write_paused", "pause_reading", "resume_reading", "drain"),
    "ServerState instance": ("default_headers", "tasks", "connections"),
    "uvicorn.protocols.utils": ("get_client_addr",),
    # The WebSocket protocol (ws=websockets-sansio) that websocket_protocol_class extends
    # with the batch sender of sluice.transports.websocket.SEND_TEXTS.
    "WebSocketsSansIOProtocol": ("handle_connect",),
    "WebSocketsSansIOProtocol instance": (
        "scope",
        "conn",
        "transport",
        "writable",
        "disconnected",
        "close_sent",
        "handshake_complete",
    ),
    # The drain of `sluice serve`: the signals uvicorn re-raises after its shutdown.
    "Server": ("handle_exit",),
    "Server instance": ("_captured_signals",),
}


class SluiceWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-IO WebSocket protocol with the ASGI extension
    :data:`~sluice.transports.websocket.SEND_TEXTS`: several text messages framed (by hand,
    :func:`~sluice.transports.websocket_protocol.server_text_frame`, on an open connection
    with no extension) and written at once. uvicorn's ``websocket.send`` costs
    an ASGI message, a decode, an encode and a write per message; on a socket carrying a
    token per message, that was most of the server's CPU."""

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        if not self.close_sent:  # a refused handshake has no ASGI scope
            self.scope["extensions"][SEND_TEXTS] = {"send": self._send_texts}

    async def _send_texts(self, messages: list[bytes]) -> None:
        await self.writable.wait()  # the transport's buffer is under its high mark
        if self.disconnected or self.close_sent:  # gone, or closing (a ping unanswered)
            raise ClientDisconnected()
        if not self.handshake_complete:
            raise RuntimeError("messages before websocket.accept")
        conn = self.conn
        if conn.state is not State.OPEN:
            raise ClientDisconnected()
        if conn.extensions or conn.expect_continuation_frame:
            try:  # never with this server's options (no deflate, no fragments sent)
                for message in messages:
                    conn.send_text(message)
            except InvalidState:
                raise ClientDisconnected() from None
            self.transport.write(b"".join(conn.data_to_send()))
            return
        # Framed here: websockets' send_text builds a Frame object per message and keeps no
        # state for an unfragmented one; what it queued before (a pong) goes first.
        data = conn.data_to_send()
        data.extend(server_text_frame(message) for message in messages)
        self.transport.write(b"".join(data))


class _Pipeline(list[Any]):
    """The queue of pipelined requests, as a list: an empty deque costs ~600 bytes per
    connection, an empty list ~56, and nearly every connection's queue stays empty."""

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


class _FlowControl(FlowControl):
    """uvicorn's flow control, whose event (and its waiter deque) is made only when a
    writer actually has to wait for a full transport buffer."""

    def __init__(self, transport: asyncio.Transport) -> None:  # replaces, not extends
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._event: asyncio.Event | None = None

    async def drain(self) -> None:
        if self.write_paused:
            if self._event is None:
                self._event = asyncio.Event()
            await self._event.wait()

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            if self._event is not None:
                self._event.clear()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            if self._event is not None:
                self._event.set()


def protocol_class(opener: Opener, *, native: bool = True) -> type[SluiceHttpProtocol]:
    """The protocol class of one server: its connections share one
    :class:`BusyConnections` and ``opener``; with ``native=False`` every request goes
    through the ASGI app (the bounds, deadlines and connection limit still apply)."""
    namespace = {
        "__slots__": (),
        "opener": opener,
        "native": native,
        "busy": BusyConnections(),
    }
    return cast(
        type[SluiceHttpProtocol],
        type(SluiceHttpProtocol.__name__, (SluiceHttpProtocol,), namespace),
    )


def exit_without_reraise(server: uvicorn.Server, sig: int, frame: FrameType | None) -> None:
    """uvicorn's own ``handle_exit``, minus its re-raising of SIGTERM after the shutdown:
    a drained server exits 0 (a supervisor asked for exactly this stop)."""
    uvicorn.Server.handle_exit(server, sig, frame)
    captured: list[int] = server._captured_signals
    if sig == signal.SIGTERM and sig in captured:
        captured.remove(sig)


class SluiceHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with our bounds, deadlines and native answers."""

    # Set on the class of one server by protocol_class().
    opener: ClassVar[Opener]
    native: ClassVar[bool] = True
    busy: ClassVar[BusyConnections | None] = None

    # Slots keep the per-connection instance dict of the base class from growing.
    __slots__ = (
        "closing",
        "discarding",
        "exchange",
        "in_head",
        "in_request",
        "linger",
        "max_busy",
        "meter",
        "native_message",
        "num_discarded_bytes",
        "read_deadline",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.busy is None:
            raise TypeError("make the protocol class with protocol_class()")
        limits = self.opener.limits
        self.exchange: NativeExchange | None = None
        self.native_message = False  # the message being parsed is answered natively
        self.closing = False  # the server is shutting down
        self.pipeline = _Pipeline()  # type: ignore[assignment]
        # --max-connections: busy connections (see BusyConnections), checked here; uvicorn's
        # own check, which counts idle connections too, is off.
        self.max_busy: int | None = self.limit_concurrency
        self.limit_concurrency = None
        self.in_request = False  # counted in self.busy
        self.discarding = False  # no more requests are parsed: what arrives is dropped
        self.num_discarded_bytes = 0
        self.linger: asyncio.TimerHandle | None = None  # a lingering close is under way
        self.in_head = False  # between a message's first byte and the end of its head
        self.meter = HeadMeter(limits)
        self.read_deadline = ReadDeadline(
            self.loop,
            head_s=limits.head_timeout_s,
            body_s=limits.body_timeout_s,
            on_expired=self._read_timed_out,
            reading_paused=self._reading_paused,
        )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _FlowControl(transport)
        self.read_deadline.head_begins()  # a silent connection is closed at its deadline

    # ------------------------------------------------------------------ head limits

    def data_received(self, data: bytes) -> None:
        if self.discarding:
            self._discard(len(data))
            return
        super().data_received(data)
        if self.in_head and not self.discarding:
            refusal = self.meter.on_data(len(data))
            if refusal is not None:
                self._refuse_head(refusal)

    def on_message_begin(self) -> None:
        if self.discarding:
            return
        if self.exchange is not None:
            # Pipelined behind a native answer: not served (see the module docstring).
            self._stop_reading_requests()
            return
        super().on_message_begin()
        self.opener.began(cast(Scope, self.scope))
        self.in_head = True
        self.meter.begin()
        self.read_deadline.head_begins()

    def on_url(self, url: bytes) -> None:
        if self.discarding:
            return
        super().on_url(url)
        refusal = self.meter.on_url(len(url))
        if refusal is not None:
            self._refuse_head(refusal)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.discarding:
            return
        refusal = self.meter.on_header(name, value)
        if refusal is not None:
            self._refuse_head(refusal)
            return
        super().on_header(name, value)

    def _refuse_head(
        self, reason: Refusal, method: str | None = None, path: str | None = None
    ) -> None:
        """Answer a request refused from its head (unless a response is under way: that
        one ends, then the connection closes) and hang up."""
        self.in_head = False
        under_way = self._response_under_way()
        self._stop_reading_requests()
        if not under_way:
            self._write_whole(self.opener.refusal(reason, method, path))

    # ------------------------------------------------------------------ deadlines

    def _reading_paused(self) -> bool:
        return self.flow is not None and self.flow.read_paused

    def _read_timed_out(self, phase: ReadPhase) -> None:
        """A head or body did not arrive in time: answer ``408`` where nothing else is being
        answered, and close."""
        if self.transport.is_closing() or self.discarding:
            return
        if phase is ReadPhase.HEAD:
            if self._response_under_way():
                self._stop_reading_requests()  # the response in progress ends, then close
                return
            if not self.in_head:  # it never sent a byte of this request: nothing to answer
                self._stop_reading_requests()
                self.transport.close()
                return
            reason = Refusal.HEAD_TIMEOUT
        else:
            exchange = self.exchange
            if exchange is not None:
                if exchange.responded:
                    self.transport.close()  # its answer is under way: cut it
                    return
                exchange.abandon()  # the route stops waiting for the body
                self.exchange = None
            else:
                cycle = self.cycle
                if cycle is None or cycle.response_started or self.pipeline:
                    self.transport.close()  # its response is under way (or done): cut it
                    return
                cycle.disconnected = True  # the app stops waiting for the body, writes nothing
                cycle.message_event.set()
            reason = Refusal.BODY_TIMEOUT
        self.in_head = False
        self._stop_reading_requests()
        self._write_whole(self.opener.refusal(reason, None, None))

    # ------------------------------------------------------------------ closing

    def _response_under_way(self) -> bool:
        return self.exchange is not None or (
            self.cycle is not None and not self.cycle.response_complete
        )

    def _stop_reading_requests(self) -> None:
        """Parse no more requests on this connection: drop what arrives, end the response
        under way (if any) and close. The client retries what was not answered."""
        self.discarding = True
        self.read_deadline.cancel()
        if self.exchange is not None:
            self.exchange.stop_keep_alive()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False  # the last request queued or in progress closes it

    def _discard(self, num_bytes: int) -> None:
        self.num_discarded_bytes += num_bytes
        if self.num_discarded_bytes <= _MAX_DISCARD_BYTES:
            return
        if self.linger is not None:
            self.transport.close()
        else:
            self.flow.pause_reading()  # behind a response under way: read no more

    def _close_lingering(self) -> None:
        """Close after a response, the lingering way (see ``_LINGER_S``)."""
        transport = self.transport
        self.discarding = True
        self.read_deadline.cancel()
        if transport.is_closing() or self.linger is not None:
            return
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()  # our FIN: the client reads the whole response, then EOF
        self.num_discarded_bytes = 0
        self.linger = self.loop.call_later(_LINGER_S, transport.close)
        self.flow.resume_reading()  # read (and drop) what it still sends; its EOF closes

    # ------------------------------------------------------------------ parser callbacks

    def on_headers_complete(self) -> None:
        if self.discarding:
            return
        self.in_head = False
        self.read_deadline.head_complete()
        parser = self.parser
        max_busy = self.max_busy
        busy = self.busy
        assert busy is not None  # checked in __init__
        over_limit = max_busy is not None and not self.in_request and busy.count >= max_busy
        if parser.should_upgrade() and not over_limit:
            if not self._should_upgrade():
                self._begin_request()  # an upgraded connection leaves this protocol
            super().on_headers_complete()
            return
        method = parser.get_method().decode("ascii")
        parsed = httptools.parse_url(self.url)
        path = parsed.path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        http_version = parser.get_http_version()
        scope = self.scope
        if over_limit:
            scope["method"] = method
            scope["http_version"] = http_version
            scope["path"] = path
            scope["query_string"] = parsed.query or b""
            self._refuse_head(Refusal.TOO_MANY_CONNECTIONS, method, path)
            return
        self._begin_request()
        under_way = self.cycle is not None and not self.cycle.response_complete
        route = self.opener.route(method, path) if self.native and not under_way else None
        if route is None:
            super().on_headers_complete()
            return
        scope["method"] = method
        scope["http_version"] = http_version
        scope["path"] = path
        scope["raw_path"] = parsed.path
        scope["query_string"] = parsed.query or b""
        self.cycle = None  # type: ignore[assignment]
        self.native_message = True
        keep_alive = http_version != "1.0" and parser.should_keep_alive() and not self.closing
        exchange = NativeExchange(
            route,
            cast(Scope, scope),
            self.opener,
            self.transport,
            keep_alive=keep_alive,
            chunked=http_version != "1.0",
            host=self,
        )
        self.exchange = exchange
        # The exchange holds the request now: the connection keeps nothing of it for the
        # life of a possibly hours-long stream (the next request makes new ones).
        self.scope = None  # type: ignore[assignment]
        self.headers = None  # type: ignore[assignment]
        self.url = b""
        exchange.start(self._adopt)

    def on_body(self, body: bytes) -> None:
        if self.discarding:
            return
        if self.native_message:
            if self.exchange is not None:
                self.exchange.feed_body(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self.discarding:
            return
        self.read_deadline.body_complete()
        if self.native_message:
            self.native_message = False
            if self.exchange is not None:
                self.exchange.body_complete()
            return
        super().on_message_complete()
        if self.parser.should_upgrade() and not self._should_upgrade():
            # An Upgrade we do not speak: what follows is not HTTP/1.1 (httptools stops
            # parsing here). Answer this request, then close.
            self._stop_reading_requests()

    def on_response_complete(self) -> None:
        if not self.pipeline:
            self._end_request()
        super().on_response_complete()

    def _begin_request(self) -> None:
        if not self.in_request:
            self.in_request = True
            busy = self.busy
            assert busy is not None  # checked in __init__
            busy.count += 1

    def _end_request(self) -> None:
        if self.in_request:
            self.in_request = False
            busy = self.busy
            assert busy is not None  # checked in __init__
            busy.count -= 1

    # ------------------------------------------------------------------ transport events

    def connection_lost(self, exc: Exception | None) -> None:
        self.read_deadline.cancel()
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
        self._end_request()
        if self.exchange is not None:
            self.exchange.connection_lost()
            self.exchange = None
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.exchange is not None:
            self.exchange.pause_writing()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.exchange is not None:
            self.exchange.resume_writing()

    def shutdown(self) -> None:
        self.closing = True
        if self.exchange is None:
            super().shutdown()
            return
        self.exchange.shutdown()  # ends on an event boundary, then closes

    # ------------------------------------------------------------------ native answers

    def _adopt(self, task: asyncio.Task[None]) -> None:
        """The server waits for its connections' tasks when it stops."""
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def default_headers(self) -> list[tuple[bytes, bytes]]:
        return self.server_state.default_headers

    def send_continue(self) -> None:
        """The route reads the body: a client that asked (``Expect: 100-continue``, RFC
        9110 section 10.1.1) may send it now."""
        if self.expect_100_continue and not self.transport.is_closing():
            self.expect_100_continue = False
            self.transport.write(_CONTINUE)

    def log_access(self, scope: Scope | None, status: int) -> None:
        if not self.access_log or scope is None:
            return
        # Quoted as uvicorn quotes its own lines: a decoded %0d%0a would forge a line.
        target = urllib.parse.quote(scope.get("path", "-"))
        query = scope.get("query_string", b"")
        if query:
            target += "?" + query.decode("latin-1")
        self.access_logger.info(
            '%s - "%s %s HTTP/%s" %d',
            get_client_addr(cast(Any, scope)),
            scope.get("method", "-"),
            target,
            scope.get("http_version", "1.1"),
            status,
        )

    def _write_whole(self, whole: Whole) -> None:
        """Write a refusal of the protocol's own, then close (lingering)."""
        if self.transport.is_closing():
            return
        self.log_access(cast(Scope | None, self.scope), whole.status)
        head = response_head(
            whole.status,
            [*self.server_state.default_headers, *whole.with_length()],
            keep_alive=False,
        )
        self.transport.write(head + whole.body)
        self._end_request()
        self._close_lingering()

    def exchange_done(self, keep_alive: bool) -> None:
        self.exchange = None
        self._end_request()
        if not keep_alive or self.discarding:
            self._close_lingering()
            return
        self.on_response_complete()

    def exchange_cut(self) -> None:
        self.exchange = None
        self.transport.abort()
