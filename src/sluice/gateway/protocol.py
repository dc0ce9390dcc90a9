"""The HTTP/1.1 protocol ``sluice serve`` runs: uvicorn's, with SSE reads served natively.

uvicorn takes its HTTP protocol as a class (``uvicorn.Config(http=...)``). This one is
uvicorn's httptools protocol with one change: a request that
:meth:`EventStreams.handles <sluice.gateway.streaming.EventStreams.handles>` (the SSE reads)
is not run as an ASGI task. A short task decides what it gets (reader, 204 or error); from
then on an :class:`~sluice.transports.sse.SSEConnection` writes the log's frames straight to
the transport, driven by callbacks:

- no ASGI task, receive/send coroutines or disconnect watcher stays alive per stream;
- ``connection_lost`` detaches the reader at once (the hub may cancel the stream);
- ``pause_writing``/``resume_writing`` stop and restart reading the log (backpressure);
- a graceful shutdown ends each stream on an event boundary;
- request heads are bounded while they are parsed (httptools bounds neither the target nor
  the header lines): a target over ``Settings.max_url_bytes`` is answered 414, header lines
  over ``Settings.max_header_bytes`` 431, and the connection closed, before the head is
  buffered whole;
- requests are bounded in time (:mod:`sluice.gateway.deadline`): a head must arrive within
  ``Settings.head_timeout_s`` of the connection (or, kept alive, of its first byte), a body
  within ``Settings.body_timeout_s`` of its head; past that the request is answered
  ``408`` where no response is under way, and the connection closed (a connection that
  never sent a byte is just closed);
- uvicorn's ``limit_concurrency`` (``sluice serve --max-connections``) counts the
  connections *inside a request* (its head received, its response not yet complete; an
  SSE stream for its whole life), not idle or half-sent ones, which the deadlines close:
  a request that would make one more is refused like a full server (``503`` +
  ``Retry-After``; an SSE read gets a ``retry:`` hint, see
  :func:`~sluice.gateway.streaming.refusal`) and its connection closed;
- pipelining: a request pipelined behind an SSE response is not served (it would wait for
  the end of a stream that may last hours); the SSE response is delivered whole, with
  ``connection: close`` where its head is still to be written, then the connection is
  closed, and the client retries the unanswered request on a new one (RFC 9112 section
  9.3.2). Requests pipelined behind other responses are queued and served in order, as
  uvicorn does. An ``Upgrade`` this server does not speak (WebSocket, ``ws="none"``) is
  answered as a plain request, then the connection is closed, since what follows on it is
  not HTTP/1.1;
- every close after a refusal or a deadline is a lingering close: the write side is shut
  first and what the client still sends is read and dropped for a moment, so its kernel
  does not answer the unread bytes with a reset that destroys the response (a 431 to a
  200 KB head arrives);
- with uvicorn's access log on, SSE responses served here are logged as uvicorn logs the
  others (``uvicorn.access``, the path percent-quoted).

The protocol class of a server is made by :meth:`SluiceHttpProtocol.for_server`: its
connections share one count of busy connections, and ``native_sse=False`` sends every
request, SSE reads included, through the ASGI app (the deadlines, head bounds and
connection limit still apply). Every other request, and every SSE read when the app is
served by another ASGI server, goes through the ASGI app unchanged. uvicorn is pinned:
this subclass relies on its parser callbacks (``on_message_begin``,
``on_headers_complete``, ``on_body``, ``on_message_complete``), on
``on_response_complete`` for keep-alive, and on its request cycle's ``keep_alive``,
``response_started``, ``response_complete``, ``disconnected`` and ``message_event``.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any, ClassVar, cast

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr

from sluice.errors import CapacityError, SluiceError
from sluice.gateway.deadline import ReadDeadline, ReadPhase
from sluice.gateway.errors import error_response, response_for
from sluice.gateway.limits import HEADER_LINE_OVERHEAD, header_bytes_error, url_bytes_error
from sluice.gateway.requests import stamp_received
from sluice.gateway.settings import Settings
from sluice.gateway.streaming import EventStreams, refusal
from sluice.observability.metrics import Metrics
from sluice.transports.asgi import Scope
from sluice.transports.sse import SSE_HEADERS, SSEConnection, set_write_deadline

__all__ = ["BusyConnections", "SluiceHttpProtocol"]

_LAST_CHUNK = b"0\r\n\r\n"
# httptools hands a header line over only once it is whole, so a single endless line would
# be buffered inside the parser: the raw bytes of an unfinished head are bounded too, with
# one socket read of slack (a read may also carry the end of the previous request).
_HEAD_READ_SLACK_BYTES = 64 * 1024
# What a request refused for the connection limit is told to wait (``Retry-After``).
_CONNECTION_LIMIT_RETRY_AFTER_S = 1.0
# Lingering close (as Apache's and nginx's): after the response, the write side is shut
# and what the client still sends is dropped for this long (nginx: lingering_time) or this
# many bytes, then the socket is closed. Closing at once with unread bytes makes the kernel
# send a reset, which can destroy the response in flight.
_LINGER_S = 2.0
_MAX_DISCARD_BYTES = 1024 * 1024


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


class BusyConnections:
    """How many of one server's connections are inside a request now (its head received,
    its response not complete): what ``--max-connections`` bounds."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class SluiceHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with read deadlines and callback-driven SSE reads."""

    # Set on the class of one server by for_server().
    native_sse: ClassVar[bool] = True
    busy: ClassVar[BusyConnections | None] = None

    # Slots keep the per-connection instance dict of the base class from growing.
    __slots__ = (
        "discarding",
        "head_limits",
        "in_head",
        "in_request",
        "linger",
        "max_busy",
        "num_discarded_bytes",
        "num_head_bytes",
        "num_header_bytes",
        "read_deadline",
        "sse",
        "sse_chunked",
        "sse_closing",
        "sse_keep_alive",
        "sse_request",
        "sse_streams",
    )

    @classmethod
    def for_server(cls, *, native_sse: bool = True) -> type[SluiceHttpProtocol]:
        """The protocol class of one server: its connections share one
        :class:`BusyConnections`; with ``native_sse=False`` SSE reads go through the ASGI
        app like every other request."""
        namespace = {"__slots__": (), "native_sse": native_sse, "busy": BusyConnections()}
        return cast(type[SluiceHttpProtocol], type(cls.__name__, (cls,), namespace))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.busy is None:
            raise TypeError("make the protocol class with SluiceHttpProtocol.for_server()")
        self.sse_streams: EventStreams | None = getattr(self.config.app, "streams", None)
        self.sse: SSEConnection | None = None
        self.sse_request = False  # the current request is an SSE read served here
        self.sse_keep_alive = False
        self.sse_chunked = True
        self.sse_closing = False  # the server is shutting down
        self.pipeline = _Pipeline()  # type: ignore[assignment]
        limits = getattr(self.config.app, "settings", None)
        self.head_limits: Settings = limits if isinstance(limits, Settings) else Settings()
        # --max-connections: busy connections (see BusyConnections), checked here; uvicorn's
        # own check, which counts idle connections too, is off.
        self.max_busy: int | None = self.limit_concurrency
        self.limit_concurrency = None
        self.in_request = False  # counted in self.busy
        self.discarding = False  # no more requests are parsed: what arrives is dropped
        self.num_discarded_bytes = 0
        self.linger: asyncio.TimerHandle | None = None  # a lingering close is under way
        self.in_head = False  # between a message's first byte and the end of its head
        self.num_head_bytes = 0  # raw bytes read while in the head
        self.num_header_bytes = 0  # header lines parsed, as on the wire
        self.read_deadline = ReadDeadline(
            self.loop,
            head_s=self.head_limits.head_timeout_s,
            body_s=self.head_limits.body_timeout_s,
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
            self.num_head_bytes += len(data)
            limits = self.head_limits
            bound = limits.max_header_bytes + limits.max_url_bytes + _HEAD_READ_SLACK_BYTES
            if self.num_head_bytes > bound:
                error = header_bytes_error(self.num_head_bytes, limits)
                if error is not None:  # always, since the bound is above the limit
                    self._refuse_head(error)

    def on_message_begin(self) -> None:
        if self.discarding:
            return
        if self.sse_request:
            # Pipelined behind a live SSE response: not served (see the module docstring).
            self._stop_reading_requests()
            return
        super().on_message_begin()
        stamp_received(cast(Scope, self.scope))
        self.in_head = True
        self.num_head_bytes = 0
        self.num_header_bytes = 0
        self.read_deadline.head_begins()

    def on_url(self, url: bytes) -> None:
        if self.discarding:
            return
        super().on_url(url)
        error = url_bytes_error(len(self.url), self.head_limits)
        if error is not None:
            self._refuse_head(error)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.discarding:
            return
        self.num_header_bytes += len(name) + len(value) + HEADER_LINE_OVERHEAD
        error = header_bytes_error(self.num_header_bytes, self.head_limits)
        if error is not None:
            self._refuse_head(error)
            return
        super().on_header(name, value)

    def _refuse_head(self, error: SluiceError, *, sse: bool = True) -> None:
        """Answer a request refused from its head (unless a response is under way: that
        one ends, then the connection closes) and hang up; ``sse=False`` answers as the
        JSON routes do (a full server: ``503`` + ``Retry-After``), not as an SSE read (a
        ``retry:`` hint)."""
        self.in_head = False
        if self._response_under_way():
            self._stop_reading_requests()
            return
        self._stop_reading_requests()
        if sse:
            self._write_whole(*refusal(error))
        else:
            response = response_for(error)
            self._write_whole(
                response.status_code, list(response.raw_headers), bytes(response.body)
            )

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
            message = f"request head not received within {self.head_limits.head_timeout_s:g} s"
        else:
            cycle = self.cycle
            if self.sse_request or cycle is None or cycle.response_started or self.pipeline:
                self.transport.close()  # its response is under way (or done): cut it
                return
            cycle.disconnected = True  # the app stops waiting for the body, and writes nothing
            cycle.message_event.set()
            message = f"request body not received within {self.head_limits.body_timeout_s:g} s"
        self.in_head = False
        self._stop_reading_requests()
        response = error_response(408, "request_timeout", message)
        self._write_whole(408, list(response.raw_headers), bytes(response.body))

    # ------------------------------------------------------------------ closing

    def _response_under_way(self) -> bool:
        return self.sse_request or (self.cycle is not None and not self.cycle.response_complete)

    def _stop_reading_requests(self) -> None:
        """Parse no more requests on this connection: drop what arrives, end the response
        under way (if any) and close. The client retries what was not answered."""
        self.discarding = True
        self.read_deadline.cancel()
        self.sse_keep_alive = False
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
        method = self.parser.get_method().decode("ascii")
        max_busy = self.max_busy
        busy = self.busy
        assert busy is not None  # checked in __init__
        over_limit = max_busy is not None and not self.in_request and busy.count >= max_busy
        streams = self.sse_streams
        if (streams is None or self.parser.should_upgrade()) and not over_limit:
            if not (self.parser.should_upgrade() and self._should_upgrade()):
                self._begin_request()  # an upgraded connection leaves this protocol
            super().on_headers_complete()
            return
        parsed = httptools.parse_url(self.url)
        path = parsed.path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        http_version = self.parser.get_http_version()
        if over_limit:
            self._refuse_over_limit(method, path, parsed.query or b"", http_version)
            return
        self._begin_request()
        under_way = self.cycle is not None and not self.cycle.response_complete
        if streams is None or not self.native_sse or under_way or not streams.handles(method, path):
            super().on_headers_complete()
            return
        self.scope["method"] = method
        self.scope["http_version"] = http_version
        self.scope["path"] = path
        self.scope["raw_path"] = parsed.path
        self.scope["query_string"] = parsed.query or b""
        self.cycle = None  # type: ignore[assignment]
        self.sse_request = True
        self.sse_keep_alive = (
            http_version != "1.0" and self.parser.should_keep_alive() and not self.sse_closing
        )
        self.sse_chunked = http_version != "1.0"
        scope: Scope = cast(Scope, self.scope)
        task = self.loop.create_task(self._open_sse(streams, scope))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _refuse_over_limit(
        self, method: str, path: str, query_string: bytes, http_version: str
    ) -> None:
        """Answer a request over the busy-connection limit as a full server and hang up."""
        self.scope["method"] = method
        self.scope["http_version"] = http_version
        self.scope["path"] = path
        self.scope["query_string"] = query_string
        metrics = getattr(self.config.app, "metrics", None)
        if isinstance(metrics, Metrics):
            metrics.refusals.labels("max_connections").inc()
        error = CapacityError(
            "too many open connections; retry later",
            retry_after_s=_CONNECTION_LIMIT_RETRY_AFTER_S,
            reason="max_connections",
        )
        streams = self.sse_streams
        if streams is not None and streams.handles(method, path):
            self._refuse_head(error)  # a retry: hint, so EventSource comes back
        else:
            self._refuse_head(error, sse=False)

    def on_body(self, body: bytes) -> None:
        if not self.sse_request and not self.discarding:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.discarding:
            return
        self.read_deadline.body_complete()
        if self.sse_request:
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
        if self.sse is not None:
            self.sse.connection_lost()
            self.sse = None
        self.sse_request = False
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.sse is not None:
            self.sse.pause_writing()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.sse is not None:
            self.sse.resume_writing()

    def shutdown(self) -> None:
        self.sse_closing = True
        if not self.sse_request:
            super().shutdown()
            return
        self.sse_keep_alive = False
        if self.sse is not None:
            self.sse.interrupt()  # ends on an event boundary, then closes
        # else: the stream is still opening; it is interrupted as soon as it starts

    # ------------------------------------------------------------------ the SSE response

    async def _open_sse(self, streams: EventStreams, scope: Scope) -> None:
        try:
            reader = await streams.open(scope)
        except SluiceError as exc:
            self._write_whole(*refusal(exc))
            return
        if reader is None:
            # 204 tells EventSource the stream is over: it stops reconnecting.
            self._write_whole(204, [], b"")
            return
        if self.transport.is_closing():
            reader.close()  # the client left while we decided
            self.sse_request = False
            return
        headers = [*SSE_HEADERS, *streams.cors_headers(scope)]
        self._write_head(200, headers, chunked=self.sse_chunked)
        write = self._write_chunk if self.sse_chunked else self.transport.write
        self.sse = SSEConnection(reader, streams.options, write=write, finish=self._finish_sse)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # A peer gone without a FIN never fills the buffer (heartbeats are small), so
            # the kernel gives up on its unacknowledged data: after two heartbeats, or the
            # send timeout if longer, plus 5 s so a live but stuck peer (zero window) meets
            # the send timeout (and its metric) first. Defaults: 35 s.
            options = streams.options
            deadline_s = max(2 * options.heartbeat_interval_s, options.send_timeout_s) + 5.0
            set_write_deadline(sock, deadline_s)
        # The request is fully handled: drop its scope, headers and URL for the life of a
        # possibly hours-long stream (the next request on this connection makes new ones).
        self.scope = None  # type: ignore[assignment]
        self.headers = None  # type: ignore[assignment]
        self.url = b""
        self.sse.start()
        if self.sse_closing and self.sse is not None:
            self.sse.interrupt()

    def _write_head(
        self, status: int, headers: list[tuple[bytes, bytes]], *, chunked: bool
    ) -> None:
        if self.access_log and self.scope is not None:
            scope = self.scope
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
        parts = [STATUS_LINE[status]]
        for name, value in (*self.server_state.default_headers, *headers):
            parts += [name, b": ", value, b"\r\n"]
        if chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
        if not self.sse_keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self.transport.write(b"".join(parts))

    def _write_whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        if self.transport.is_closing():
            self.sse_request = False
            return
        if status != 204 and not any(name == b"content-length" for name, _ in headers):
            headers = [*headers, (b"content-length", str(len(body)).encode())]
        self._write_head(status, headers, chunked=False)
        if body:
            self.transport.write(body)
        self._response_done()

    def _write_chunk(self, body: bytes) -> None:
        self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    def _finish_sse(self, clean: bool) -> None:
        self.sse = None
        if self.transport.is_closing():
            self.sse_request = False
            return
        if not clean:  # a stuck or interrupted peer: drop what it did not take, and the socket
            self.sse_request = False
            self.transport.abort()
            return
        if not self.sse_chunked:
            self.sse_keep_alive = False
        if self.sse_chunked:
            self.transport.write(_LAST_CHUNK)
        self._response_done()

    def _response_done(self) -> None:
        self.sse_request = False
        self._end_request()
        if not self.sse_keep_alive:
            self._close_lingering()
            return
        self.on_response_complete()
