"""One HTTP/2 connection of ``sluice serve --http2``: our protocol over the sans-IO ``h2``.

Shaped like the native HTTP/1.1 path (:mod:`sluice.transports.http1.protocol`): a request
the application's :class:`~sluice.transports.http1.opener.Opener` routes to the native path
(the SSE reads, the compatible APIs' ``POST``) is answered by its
:class:`~sluice.transports.http1.opener.Route`, and a streamed answer is written through
the delivery core by callbacks (:class:`~sluice.transports.sse.CallbackSSE`): no ASGI
task, ``receive``/``send`` coroutines or send task per stream. Every other request runs the
ASGI app (:class:`_AsgiStream`). The bytes ``h2`` makes for the streams of one loop pass
are written in one send per connection (the opener's
:class:`~sluice.transports.http1.write_batch.WriteBatch`): an engine step's tokens for a
hundred streams multiplexed on one connection are one ``write``.

Flow control (RFC 9113 section 5.2) is per stream: what a stream's window does not take
waits in that stream's backlog, and past :data:`STREAM_HIGH_WATER` its writer is paused
(an SSE stream stops reading its log and meets the delivery core's send timeout, then is
reset; an ASGI ``send`` waits), so one stalled stream never stalls the others on its
connection. A full transport buffer pauses every stream of the connection, as on HTTP/1.1.

Deliberate choices:

1. Hop-by-hop headers (``connection``, ``keep-alive``, ``transfer-encoding``, ...) are
   dropped from responses: RFC 9113 section 8.2.2 makes them malformed on h2.
2. A stream the server gives up on (its reader stuck past the send timeout, an answer that
   failed after its head) is reset with ``CANCEL``; the connection and its other streams
   live on. A request body over the limit is the route's ``413``, as on HTTP/1.1.
3. Extended CONNECT (RFC 8441, WebSocket over h2) is not offered: ``/v1/ws`` is served on
   HTTP/1.1, on either port.
4. No server push, no priorities: every stream's bytes go out as its window allows, in the
   order they were made.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import urllib.parse
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any, Final, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from sluice.transports.answer import Answer, Streamed, Whole
from sluice.transports.asgi import ASGIApp, Message, Scope
from sluice.transports.delivery import Delivery, kernel_write_deadline_s
from sluice.transports.http1.opener import Opener, Refusal, Route
from sluice.transports.http1.protocol import (
    INTERNAL_ERROR,
    RequestBody,
    no_body,
    set_write_deadline,
)
from sluice.transports.sse import SSE_HEADERS, CallbackSSE

__all__ = [
    "HOP_BY_HOP",
    "MAX_CONCURRENT_STREAMS",
    "STREAM_HIGH_WATER",
    "H2Protocol",
    "H2Site",
    "response_headers",
]

logger = logging.getLogger("sluice.http2")

Header = tuple[bytes, bytes]

# SETTINGS_MAX_CONCURRENT_STREAMS: the streams one connection may hold open at once.
MAX_CONCURRENT_STREAMS: Final = 128
# A stream's bytes held behind its closed window before its writer is paused: two frames of
# the default size (16 KiB), as Hypercorn's stream buffer; resumed below half of it.
STREAM_HIGH_WATER: Final = 32 * 1024
STREAM_LOW_WATER: Final = STREAM_HIGH_WATER // 2
# RFC 9113 section 8.2.2: connection-specific header fields are malformed on h2.
HOP_BY_HOP: Final = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
# RFC 7541 section 4.1: a header's size is its name, its value and 32 octets of overhead.
_HEADER_ENTRY_OVERHEAD: Final = 32
# A DATA frame's header (RFC 9113 section 4.1): length and type (0) in one word, flags, id.
_DATA_HEAD: Final = struct.Struct(">IBI")
_GOAWAY: Final = 0x7
_GOAWAY_HEAD: Final = _DATA_HEAD  # the same frame header, type 7 on stream 0
_GOAWAY_BODY: Final = struct.Struct(">II")  # last stream id, error code (section 6.8)
_BAD_REQUEST: Final = Whole(400, ((b"content-type", b"text/plain; charset=utf-8"),), b"Bad Request")


@dataclass(eq=False)
class H2Site:
    """What the connections of one HTTP/2 listener share: the app, its opener, the tasks
    they started (the listener waits for them when it stops) and the live connections."""

    app: ASGIApp
    opener: Opener
    native: bool = True
    keep_alive_s: float = 5.0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    connections: set[H2Protocol] = field(default_factory=set)

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


class _DateHeader:
    """``date`` (RFC 9110 section 6.6.1), formatted once a second."""

    __slots__ = ("_header", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._header: Header = (b"date", b"")

    def get(self) -> Header:
        second = int(time.time())
        if second != self._second:
            self._second = second
            self._header = (b"date", formatdate(second, usegmt=True).encode())
        return self._header


_DATE = _DateHeader()


def response_headers(status: int, headers: Sequence[Header]) -> list[Header]:
    """An h2 response head: ``:status``, ``date``, then ``headers`` without the hop-by-hop
    ones (and without a ``date`` of their own)."""
    head = [(b":status", b"%d" % status), _DATE.get()]
    head += [(n, v) for n, v in headers if n not in HOP_BY_HOP and n != b"date"]
    return head


class _Stream:
    """One request and its response: the outbound half, with its flow control."""

    __slots__ = (
        "backlog",
        "conn",
        "ended",
        "ending",
        "headers_sent",
        "id",
        "lost",
        "paused",
        "scope",
    )

    def __init__(self, conn: H2Protocol, stream_id: int, scope: Scope) -> None:
        self.conn = conn
        self.id = stream_id
        self.scope: Scope | None = scope
        self.backlog = bytearray()  # what the stream's window has not taken yet
        self.headers_sent = False
        self.ending = False  # END_STREAM is due once the backlog is out
        self.ended = False  # our half is closed (or the stream reset)
        self.lost = False  # reset by the client, or the connection is gone
        self.paused = False  # its writer is paused (the backlog or the transport)

    # -- what the connection reports -------------------------------------------------

    def on_body(self, data: bytes) -> None:
        """Request body bytes (a refused request's are dropped)."""

    def on_body_complete(self) -> None:
        """The request's body is complete."""

    def on_lost(self) -> None:
        """Reset by the client, or the connection is gone."""
        self.lost = True
        self.backlog.clear()

    def pause(self) -> None:
        """Stop making body bytes: the backlog or the transport is full."""

    def resume(self) -> None:
        """Make body bytes again."""

    def shutdown(self) -> None:
        """The server is stopping: end the response as soon as it can end cleanly."""

    # -- the response ------------------------------------------------------------------

    def send_head(self, status: int, headers: Sequence[Header], *, end: bool) -> None:
        self.headers_sent = True
        self.conn.send_headers(self.id, response_headers(status, headers), end=end)
        if end:
            self._close()

    def write(self, data: bytes) -> None:
        """Body bytes: sent as the stream's window allows, the rest held."""
        if self.ended or self.lost or not data:
            return
        if self.backlog:
            self.backlog += data
        else:
            conn = self.conn
            sent = conn.send_data(self.id, data)
            if sent == len(data):
                return
            self.backlog += data[sent:] if sent else data
        if len(self.backlog) > STREAM_HIGH_WATER:
            self._update_paused()

    def end(self) -> None:
        """The body is complete: END_STREAM, once the backlog is out."""
        if self.ended or self.lost:
            return
        if self.backlog:
            self.ending = True
            return
        self.conn.end_stream(self.id)
        self._close()

    def reset(self, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.CANCEL) -> None:
        """Give up on the stream (``RST_STREAM``); its neighbours live on."""
        if self.ended or self.lost:
            return
        self.backlog.clear()
        self.conn.reset_stream(self.id, code)
        self._close()

    def on_window(self) -> None:
        """The window opened (the stream's or the connection's): send what it takes."""
        backlog = self.backlog
        if not backlog or self.lost:
            return
        sent = self.conn.send_data(self.id, bytes(backlog))
        if sent:
            del backlog[:sent]
        if not backlog and self.ending:
            self.ending = False
            self.conn.end_stream(self.id)
            self._close()
            return
        self._update_paused()

    def _update_paused(self) -> None:
        should = len(self.backlog) > STREAM_HIGH_WATER or (
            self.conn.transport_paused and not self.ended
        )
        if should and not self.paused:
            self.paused = True
            self.pause()
        elif not should and self.paused and len(self.backlog) <= STREAM_LOW_WATER:
            self.paused = False
            self.resume()

    def _close(self) -> None:
        self.ended = True
        self.conn.stream_ended(self)


class _NativeStream(_Stream):
    """A request the native path answers: the route's answer, written by callbacks."""

    __slots__ = ("body", "deadline", "route", "sse", "task")

    def __init__(self, conn: H2Protocol, stream_id: int, scope: Scope, route: Route) -> None:
        super().__init__(conn, stream_id, scope)
        self.route = route
        site = conn.site
        limits = site.opener.limits
        self.body: RequestBody | None = None
        self.deadline: asyncio.TimerHandle | None = None
        if route.takes_body:
            self.body = RequestBody(limits.max_body_bytes, _nothing)
            loop = asyncio.get_running_loop()
            self.deadline = loop.call_later(limits.body_timeout_s, self._body_timed_out)
        self.sse: CallbackSSE | None = None
        self.task: asyncio.Task[None] | None = site.spawn(self._answer())

    def on_body(self, data: bytes) -> None:
        if self.body is not None:
            self.body.feed(data)

    def on_body_complete(self) -> None:
        self._stop_deadline()
        if self.body is not None:
            self.body.complete()

    def _stop_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _body_timed_out(self) -> None:
        """The body did not arrive within ``body_timeout_s``: the answer being made is
        cancelled and the request gets the opener's ``408``."""
        self.deadline = None
        scope = self.scope or {}
        if self.body is not None:
            self.body.lost()
            self.body = None
        if self.task is not None:
            self.task.cancel()
            self.task = None
        refusal = self.conn.site.opener.refusal(
            Refusal.BODY_TIMEOUT, scope.get("method"), scope.get("path")
        )
        self.respond(refusal)

    async def _answer(self) -> None:
        scope = self.scope or {}
        body = self.body
        try:
            answer = await self.route.answer(scope, no_body if body is None else body.read)
        except Exception:
            logger.exception("the answer to %s %s failed", scope.get("method"), scope.get("path"))
            answer = INTERNAL_ERROR
        self.task = None
        self.body = None
        self.respond(answer)

    def respond(self, answer: Answer) -> None:
        if self.lost or self.ended:
            if isinstance(answer, Streamed):
                answer.reader.close()  # the client left while we decided
            return
        if isinstance(answer, Whole):
            self.send_head(answer.status, answer.with_length(), end=not answer.body)
            if answer.body:
                self.write(answer.body)
                self.end()
            return
        self.send_head(200, [*SSE_HEADERS, *answer.headers], end=False)
        self.scope = None  # the request is handled: hold nothing of it for the stream's life
        sse = CallbackSSE(
            Delivery(answer.reader, answer.frames, self.conn.site.opener.delivery),
            write=self.write,
            finish=self._sse_done,
        )
        self.sse = sse
        sse.start()
        if self.conn.transport_paused and self.sse is not None and not self.paused:
            self.paused = True
            self.sse.pause_writing()
        if self.conn.shutting_down and self.sse is not None:
            self.sse.interrupt()

    def _sse_done(self, clean: bool) -> None:
        self.sse = None
        if clean:
            self.end()
        else:  # a stuck or interrupted reader gets no more
            self.reset()

    def pause(self) -> None:
        if self.sse is not None:
            self.sse.pause_writing()

    def resume(self) -> None:
        if self.sse is not None:
            self.sse.resume_writing()

    def shutdown(self) -> None:
        if self.sse is not None:
            self.sse.interrupt()

    def on_lost(self) -> None:
        super().on_lost()
        self._stop_deadline()
        if self.body is not None:
            self.body.lost()
        if self.task is not None:
            self.task.cancel()  # the answer's own cleanup closes its reader
            self.task = None
        if self.sse is not None:
            self.sse.connection_lost()
            self.sse = None


def _nothing() -> None:
    """An h2 request has no ``100 Continue`` to send when its body is read."""


class _AsgiStream(_Stream):
    """A request the ASGI app answers, through ``receive`` and ``send``."""

    __slots__ = (
        "body_given",
        "chunks",
        "complete",
        "done",
        "drained",
        "received",
        "request_ended",
        "response_head",
        "task",
        "unacknowledged",
    )

    def __init__(self, conn: H2Protocol, stream_id: int, scope: Scope) -> None:
        super().__init__(conn, stream_id, scope)
        self.chunks: list[bytes] = []  # body bytes not yet received (their window is not
        self.request_ended = False  # given back until they are: h2's own bound)
        self.complete = False  # the app sent its last body message
        self.body_given = False  # receive() has returned the whole body
        self.unacknowledged = 0  # flow-controlled bytes received, not yet given back
        self.received: asyncio.Future[None] | None = None  # receive() waits for the body
        self.drained: asyncio.Future[None] | None = None  # send() waits for the window
        self.done: asyncio.Future[None] | None = None  # receive() waits for the end
        self.response_head: tuple[int, list[Header]] | None = None
        self.task = conn.site.spawn(self._run(scope))

    async def _run(self, scope: Scope) -> None:
        try:
            await self.conn.site.app(scope, self.receive, self.send)
        except asyncio.CancelledError:
            self.reset()  # the server stopped before the response did
            raise
        except Exception:
            logger.exception("the app failed on %s %s", scope.get("method"), scope.get("path"))
        finally:
            self.scope = None
        if self.complete or self.lost:
            return
        if self.headers_sent:
            self.reset()  # the app returned (or failed) mid-response
            return
        self.complete = True  # it returned (or failed) before a response: uvicorn's 500
        whole = INTERNAL_ERROR
        self.send_head(whole.status, whole.with_length(), end=False)
        self.write(whole.body)
        self.end()

    # -- receive ---------------------------------------------------------------------

    def on_body(self, data: bytes) -> None:
        self.chunks.append(data)
        _wake(self.received)

    def on_body_complete(self) -> None:
        self.request_ended = True
        _wake(self.received)

    def _give_back(self) -> None:
        """Return the window of what was received (read, or never to be)."""
        num_bytes, self.unacknowledged = self.unacknowledged, 0
        self.conn.acknowledge(self.id, num_bytes)

    def _close(self) -> None:
        super()._close()
        self.chunks.clear()  # a body the app did not read: its window is the connection's
        self._give_back()

    def on_lost(self) -> None:
        super().on_lost()
        self.chunks.clear()
        self._give_back()
        _wake(self.received)
        _wake(self.drained)
        _wake(self.done)

    async def receive(self) -> Message:
        loop = asyncio.get_running_loop()
        if not self.body_given:
            while not self.lost and not self.chunks and not self.request_ended:
                self.received = loop.create_future()
                await self.received
                self.received = None
            if not self.lost:
                body = b"".join(self.chunks)
                self.chunks.clear()
                self._give_back()
                self.body_given = self.request_ended
                return {"type": "http.request", "body": body, "more_body": not self.body_given}
        while not self.lost and not self.complete:
            self.done = loop.create_future()
            await self.done
            self.done = None
        return {"type": "http.disconnect"}

    # -- send ------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.response_head is not None:
                raise RuntimeError("http.response.start sent twice")
            self.response_head = (message["status"], list(message.get("headers", ())))
            return
        if kind != "http.response.body":
            return  # trailers, and extensions not offered: nothing to send on h2 here
        if self.response_head is None:
            raise RuntimeError("http.response.body before http.response.start")
        if self.complete or self.lost:
            return
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if not self.headers_sent:
            status, headers = self.response_head
            self.send_head(status, headers, end=not body and not more)
        if body:
            self.write(body)
        if not more:
            self.complete = True
            self.end()
            _wake(self.done)
            return
        while self.paused and not self.lost and not self.ended:
            self.drained = asyncio.get_running_loop().create_future()
            await self.drained
            self.drained = None

    def pause(self) -> None:
        pass  # send() sees self.paused

    def resume(self) -> None:
        _wake(self.drained)

    def shutdown(self) -> None:
        pass  # the listener gives ASGI requests its grace, then cancels them


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class H2Protocol(asyncio.Protocol):
    """One HTTP/2 connection (its preface already chosen by the listener)."""

    def __init__(self, site: H2Site) -> None:
        self.site = site
        self.streams: dict[int, _Stream] = {}
        self.transport_paused = False
        self.shutting_down = False
        self._transport: asyncio.Transport | None = None
        self._batched = False  # in the opener's write batch for this loop pass
        self._out: list[bytes] = []  # frames to write, in order
        self._max_frame = 16_384  # SETTINGS_MAX_FRAME_SIZE, the peer's (RFC 9113 6.5.2)
        self._idle: asyncio.TimerHandle | None = None
        self._scheme = "http"
        self._client: tuple[str, int] | None = None
        self._server: tuple[str, int] | None = None
        limits = site.opener.limits
        self._max_header_list = limits.max_header_bytes + limits.max_url_bytes
        self._conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        codes = h2.settings.SettingCodes
        self._conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                codes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
                codes.MAX_HEADER_LIST_SIZE: self._max_header_list,
            },
        )

    # -- the connection ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not its subclasses
        self._transport = transport
        self._scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        self._client = _address(transport.get_extra_info("peername"))
        self._server = _address(transport.get_extra_info("sockname"))
        self.site.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a peer gone without a FIN is dropped by the kernel, as on h1
            set_write_deadline(sock, kernel_write_deadline_s(self.site.opener.delivery))
        self._conn.initiate_connection()
        self._write_now()
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        try:
            events = self._conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            self._write_now()  # h2's GOAWAY
            self._close()
            return
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                stream = self.streams.get(event.stream_id)
                if isinstance(stream, _AsgiStream) and not stream.ended:
                    # Its window is given back as the app reads it: h2's own bound.
                    stream.unacknowledged += event.flow_controlled_length
                    stream.on_body(event.data)
                else:
                    if stream is not None:
                        stream.on_body(event.data)
                    self.acknowledge(event.stream_id, event.flow_controlled_length)
            elif isinstance(event, h2.events.WindowUpdated):
                self._on_window(event.stream_id)
            elif isinstance(event, h2.events.RequestReceived):
                self._on_request(event)
            elif isinstance(event, h2.events.StreamEnded):
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    stream.on_body_complete()
            elif isinstance(event, h2.events.StreamReset):
                stream = self.streams.pop(event.stream_id, None)
                if stream is not None:
                    stream.on_lost()
                    self._arm_idle()
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                self._max_frame = self._conn.max_outbound_frame_size
                if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
                    self._on_window(0)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self._write_now()
                self._close()
                return
        self._write_now()

    def pause_writing(self) -> None:
        self.transport_paused = True
        for stream in list(self.streams.values()):
            if not stream.paused:
                stream.paused = True
                stream.pause()

    def resume_writing(self) -> None:
        self.transport_paused = False
        for stream in list(self.streams.values()):
            stream._update_paused()

    def connection_lost(self, exc: Exception | None) -> None:
        self.site.connections.discard(self)
        self._transport = None
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        streams = list(self.streams.values())
        self.streams.clear()
        for stream in streams:
            stream.on_lost()

    def shutdown(self) -> None:
        """The server is stopping: GOAWAY (no new streams), SSE streams end on an event
        boundary; the connection closes once its streams have ended.

        The GOAWAY is made here: once ``h2`` has sent one it refuses to send anything
        more, so the streams under way could not end."""
        self.shutting_down = True
        if self._transport is None:
            return
        last_stream_id = self._conn.highest_inbound_stream_id
        self._out.append(_GOAWAY_HEAD.pack(8 << 8 | _GOAWAY, 0, 0))
        self._out.append(_GOAWAY_BODY.pack(last_stream_id, h2.errors.ErrorCodes.NO_ERROR))
        for stream in list(self.streams.values()):
            stream.shutdown()
        self._write_now()
        if not self.streams:
            self._close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # -- requests ----------------------------------------------------------------------

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        stream_id = event.stream_id
        method = raw_target = authority = b""
        headers: list[Header] = []
        size = 0
        for name, value in event.headers:
            name, value = bytes(name), bytes(value)
            size += len(name) + len(value) + _HEADER_ENTRY_OVERHEAD
            if name[:1] != b":":
                headers.append((name, value))
            elif name == b":method":
                method = value
            elif name == b":path":
                raw_target = value
            elif name == b":authority":
                authority = value
        if authority and not any(name == b"host" for name, _ in headers):
            headers.insert(0, (b"host", authority))
        raw_path, _, query = raw_target.partition(b"?")
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        method_text = method.decode("latin-1")
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "2",
            "method": method_text,
            "scheme": self._scheme,
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self._client,
            "server": self._server,
            "state": {},
        }
        opener = self.site.opener
        opener.began(scope)
        limits = opener.limits
        refusal: Whole | None = None
        if not raw_path.startswith(b"/"):
            refusal = _BAD_REQUEST
        elif len(raw_target) > limits.max_url_bytes:
            refusal = opener.refusal(Refusal.URL_TOO_LONG, method_text, path)
        elif size > self._max_header_list:
            refusal = opener.refusal(Refusal.HEADERS_TOO_LARGE, method_text, path)
        if refusal is not None or self.shutting_down:
            stream = _Stream(self, stream_id, scope)
            self.streams[stream_id] = stream
            if refusal is None:  # after our GOAWAY: the client may retry it elsewhere
                stream.reset(h2.errors.ErrorCodes.REFUSED_STREAM)
            else:
                stream.send_head(refusal.status, refusal.with_length(), end=False)
                stream.write(refusal.body)
                stream.end()
            return
        route = opener.route(method_text, path) if self.site.native else None
        if route is not None:
            self.streams[stream_id] = _NativeStream(self, stream_id, scope, route)
        else:
            self.streams[stream_id] = _AsgiStream(self, stream_id, scope)

    # -- what streams call -------------------------------------------------------------

    def send_headers(self, stream_id: int, headers: list[Header], *, end: bool) -> None:
        try:
            self._conn.send_headers(stream_id, headers, end_stream=end)
        except (h2.exceptions.ProtocolError, KeyError):
            return  # the stream is gone
        self._take_h2_bytes()

    def send_data(self, stream_id: int, data: bytes) -> int:
        """Send what the stream's window takes of ``data`` now; the number of bytes sent.

        The DATA frames (RFC 9113 section 6.1: no padding, no flags) are made here, not by
        ``h2`` (its ``send_data`` was most of a token's cost on this path); its flow-control
        windows are debited as its own ``send_data`` would. A stream's data is only sent
        while it is open on our side (:class:`_Stream` ends or resets through ``h2``)."""
        conn = self._conn
        stream = conn.streams.get(stream_id)
        if stream is None:
            return len(data)  # the stream is gone: nothing is left to hold
        window = min(conn.outbound_flow_control_window, stream.outbound_flow_control_window)
        if window <= 0:
            return 0
        size = len(data)
        num = size if size <= window else window
        out = self._out
        max_frame = self._max_frame
        if num <= max_frame:
            out.append(_DATA_HEAD.pack(num << 8, 0, stream_id))
            out.append(data if num == size else data[:num])
        else:
            for start in range(0, num, max_frame):
                piece = data[start : min(num, start + max_frame)]
                out.append(_DATA_HEAD.pack(len(piece) << 8, 0, stream_id))
                out.append(piece)
        conn.outbound_flow_control_window -= num
        stream.outbound_flow_control_window -= num
        self._schedule()
        return num

    def end_stream(self, stream_id: int) -> None:
        try:
            self._conn.end_stream(stream_id)
        except (h2.exceptions.ProtocolError, KeyError):
            return
        self._take_h2_bytes()

    def reset_stream(self, stream_id: int, code: h2.errors.ErrorCodes) -> None:
        try:
            self._conn.reset_stream(stream_id, code)
        except (h2.exceptions.ProtocolError, KeyError):
            return
        self._take_h2_bytes()

    def acknowledge(self, stream_id: int, num_bytes: int) -> None:
        """Give ``num_bytes`` of received body back to the peer's windows."""
        if num_bytes <= 0 or self._transport is None:
            return
        try:
            self._conn.acknowledge_received_data(num_bytes, stream_id)
        except (h2.exceptions.ProtocolError, KeyError):
            self._conn.increment_flow_control_window(num_bytes)
        self._take_h2_bytes()

    def stream_ended(self, stream: _Stream) -> None:
        """Our half of ``stream`` is closed: the connection forgets it."""
        if self.streams.get(stream.id) is stream:
            del self.streams[stream.id]
        if not self.streams:
            if self.shutting_down:
                self._write_now()
                self._close()
            else:
                self._arm_idle()

    # -- writing -----------------------------------------------------------------------

    def _schedule(self) -> None:
        """Write h2's bytes at the end of this loop pass, with every other stream's."""
        if not self._batched:
            self._batched = True
            self.site.opener.writes.add(self)

    def flush(self) -> None:
        """The write batch's call."""
        self._batched = False
        self._write_now()

    def _take_h2_bytes(self) -> None:
        """Queue what ``h2`` made (after our DATA frames so far: the order is the wire's)."""
        data = self._conn.data_to_send()
        if data:
            self._out.append(data)
            self._schedule()

    def _write_now(self) -> None:
        data = self._conn.data_to_send()
        out = self._out
        if data:
            out.append(data)
        if not out:
            return
        joined = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(joined)

    def _on_window(self, stream_id: int) -> None:
        if stream_id:
            stream = self.streams.get(stream_id)
            if stream is not None:
                stream.on_window()
            return
        for stream in list(self.streams.values()):
            if stream.backlog:
                stream.on_window()

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        if self._transport is not None and not self.streams:
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(self.site.keep_alive_s, self._on_idle)

    def _on_idle(self) -> None:
        self._idle = None
        if not self.streams and self._transport is not None:
            self._conn.close_connection()
            self._write_now()
            self._close()

    def _close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()


def _address(value: object) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return (str(value[0]), int(value[1]))
    return None
