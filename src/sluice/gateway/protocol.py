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
- uvicorn's ``limit_concurrency`` (``sluice serve --max-connections``) is checked here for
  every request, SSE reads included, with uvicorn's rule (connections, this one counted,
  or request tasks at the limit): over it, the request is refused like a full server
  (``503`` + ``Retry-After``; an SSE read gets a ``retry:`` hint, see
  :func:`~sluice.gateway.streaming.refusal`) and the connection is closed, which frees it;
- with uvicorn's access log on, SSE responses served here are logged as uvicorn logs the
  others (``uvicorn.access``).

Every other request, and every SSE read when the app is served by another ASGI server,
goes through the ASGI app unchanged. uvicorn is pinned: this subclass relies on its
parser callbacks (``on_headers_complete``, ``on_body``, ``on_message_complete``) and on
``on_response_complete`` for keep-alive.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any, cast

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr

from sluice.errors import CapacityError, SluiceError
from sluice.gateway.errors import response_for
from sluice.gateway.limits import HEADER_LINE_OVERHEAD, header_bytes_error, url_bytes_error
from sluice.gateway.requests import stamp_received
from sluice.gateway.settings import Settings
from sluice.gateway.streaming import EventStreams, refusal
from sluice.observability.metrics import Metrics
from sluice.transports.asgi import Scope
from sluice.transports.sse import SSE_HEADERS, SSEConnection, set_write_deadline

__all__ = ["SluiceHttpProtocol"]

_LAST_CHUNK = b"0\r\n\r\n"
# httptools hands a header line over only once it is whole, so a single endless line would
# be buffered inside the parser: the raw bytes of an unfinished head are bounded too, with
# one socket read of slack (a read may also carry the end of the previous request).
_HEAD_READ_SLACK_BYTES = 64 * 1024
# What a request refused for the connection limit is told to wait (``Retry-After``).
_CONNECTION_LIMIT_RETRY_AFTER_S = 1.0


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


class SluiceHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with callback-driven SSE reads."""

    # Slots keep the per-connection instance dict of the base class from growing.
    __slots__ = (
        "head_limits",
        "head_refused",
        "in_head",
        "num_head_bytes",
        "num_header_bytes",
        "sse",
        "sse_chunked",
        "sse_closing",
        "sse_keep_alive",
        "sse_request",
        "sse_streams",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sse_streams: EventStreams | None = getattr(self.config.app, "streams", None)
        self.sse: SSEConnection | None = None
        self.sse_request = False  # the current request is an SSE read served here
        self.sse_keep_alive = False
        self.sse_chunked = True
        self.sse_closing = False  # the server is shutting down
        self.pipeline = _Pipeline()  # type: ignore[assignment]
        limits = getattr(self.config.app, "settings", None)
        self.head_limits: Settings = limits if isinstance(limits, Settings) else Settings()
        self.head_refused = False  # a head over the limits was answered; ignore the rest
        self.in_head = False  # between a message's first byte and the end of its head
        self.num_head_bytes = 0  # raw bytes read while in the head
        self.num_header_bytes = 0  # header lines parsed, as on the wire

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _FlowControl(transport)

    # ------------------------------------------------------------------ head limits

    def data_received(self, data: bytes) -> None:
        if self.head_refused:
            return
        super().data_received(data)
        if self.in_head and not self.head_refused:
            self.num_head_bytes += len(data)
            limits = self.head_limits
            bound = limits.max_header_bytes + limits.max_url_bytes + _HEAD_READ_SLACK_BYTES
            if self.num_head_bytes > bound:
                error = header_bytes_error(self.num_head_bytes, limits)
                if error is not None:  # always, since the bound is above the limit
                    self._refuse_head(error)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        stamp_received(cast(Scope, self.scope))
        self.in_head = True
        self.num_head_bytes = 0
        self.num_header_bytes = 0

    def on_url(self, url: bytes) -> None:
        if self.head_refused:
            return
        super().on_url(url)
        error = url_bytes_error(len(self.url), self.head_limits)
        if error is not None:
            self._refuse_head(error)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_refused:
            return
        self.num_header_bytes += len(name) + len(value) + HEADER_LINE_OVERHEAD
        error = header_bytes_error(self.num_header_bytes, self.head_limits)
        if error is not None:
            self._refuse_head(error)
            return
        super().on_header(name, value)

    def _refuse_head(self, error: SluiceError, *, sse: bool = True) -> None:
        """Answer a head over the limits (unless a response is under way) and hang up;
        ``sse=False`` answers as the JSON routes do (a full server: ``503`` +
        ``Retry-After``), not as an SSE read (a ``retry:`` hint)."""
        self.head_refused = True
        self.in_head = False
        busy = self.sse_request or (self.cycle is not None and not self.cycle.response_complete)
        if busy or self.transport.is_closing():
            self.transport.close()
            return
        self.sse_keep_alive = False
        if sse:
            self._write_whole(*refusal(error))
        else:
            response = response_for(error)
            self._write_whole(
                response.status_code, list(response.raw_headers), bytes(response.body)
            )

    # ------------------------------------------------------------------ parser callbacks

    def on_headers_complete(self) -> None:
        if self.head_refused:
            return
        self.in_head = False
        if self.sse_request:
            # A request pipelined behind a live SSE response: not supported, hang up.
            self.transport.close()
            return
        streams = self.sse_streams
        method = self.parser.get_method().decode("ascii")
        limit = self.limit_concurrency
        over_limit = limit is not None and (
            len(self.connections) >= limit or len(self.tasks) >= limit
        )
        if (streams is None or self.parser.should_upgrade()) and not over_limit:
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
        busy = self.cycle is not None and not self.cycle.response_complete
        if streams is None or busy or not streams.handles(method, path):
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
        """Answer a request over ``limit_concurrency`` as a full server and hang up."""
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
        if not self.sse_request and not self.head_refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self.sse_request and not self.head_refused:
            super().on_message_complete()

    # ------------------------------------------------------------------ transport events

    def connection_lost(self, exc: Exception | None) -> None:
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
            query = scope.get("query_string", b"")
            target = scope.get("path", "-") + ("?" + query.decode("latin-1") if query else "")
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
        if not clean or not self.sse_chunked:
            self.sse_keep_alive = False
        if self.sse_chunked and clean:
            self.transport.write(_LAST_CHUNK)
        self._response_done()

    def _response_done(self) -> None:
        self.sse_request = False
        if not self.sse_keep_alive:
            self.transport.close()
            return
        self.on_response_complete()
