"""Our HTTP/1.1 connection logic, apart from the server it runs in.

The pieces of ``sluice serve``'s protocol that touch no server internals (the uvicorn
glue is :mod:`sluice.transports.http1.uvicorn_adapter`, the only module that does):

- :class:`HeadMeter` bounds a request's head while it is parsed (httptools bounds neither
  the target nor the header lines): a target over ``max_url_bytes`` is refused 414, header
  lines over ``max_header_bytes`` 431, before the head is buffered whole;
- :class:`BusyConnections` counts the connections inside a request (``--max-connections``);
- :class:`NativeExchange` runs one request the native path answers (see
  :mod:`sluice.transports.http1.opener`): it collects the body (bounded), asks the route
  for its answer in a task, and writes that answer straight to the transport: a whole
  response, or an SSE body through the delivery core
  (:class:`~sluice.transports.sse.CallbackSSE`, chunked), driven by callbacks:

  - no ASGI task, receive/send coroutines or disconnect watcher stays alive per stream;
  - ``connection_lost`` detaches the reader at once (the hub may cancel the stream), or
    cancels the answer still being made (a ``"stream": false`` answer's generation is
    cancelled: the 499 of the ASGI path, which nobody reads);
  - ``pause_writing``/``resume_writing`` stop and restart reading the log (backpressure);
  - a graceful shutdown ends each stream on an event boundary;
  - a stream's socket gets ``TCP_USER_TIMEOUT`` (:func:`set_write_deadline`), so a peer
    gone without a FIN is dropped by the kernel.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

from sluice.transports.answer import Answer, Streamed, Whole
from sluice.transports.asgi import Scope
from sluice.transports.delivery import Delivery, kernel_write_deadline_s
from sluice.transports.http1.opener import Http1Limits, Opener, Refusal, Route
from sluice.transports.http1.writer import LAST_CHUNK, chunk, response_head
from sluice.transports.sse import SSE_HEADERS, CallbackSSE

__all__ = [
    "HEADER_LINE_OVERHEAD",
    "INTERNAL_ERROR",
    "BusyConnections",
    "ExchangeHost",
    "HeadMeter",
    "NativeExchange",
    "RequestBody",
    "no_body",
    "set_write_deadline",
]

logger = logging.getLogger("sluice.http1")

Header = tuple[bytes, bytes]

# ": " between name and value and the CRLF after it: a header line as it came on the wire.
HEADER_LINE_OVERHEAD = 4
# httptools hands a header line over only once it is whole, so a single endless line would
# be buffered inside the parser: the raw bytes of an unfinished head are bounded too, with
# one socket read of slack (a read may also carry the end of the previous request).
_HEAD_READ_SLACK_BYTES = 64 * 1024
# What a request whose answer failed inside the server gets (as uvicorn's own 500).
INTERNAL_ERROR = Whole(
    500,
    ((b"content-type", b"text/plain; charset=utf-8"),),
    b"Internal Server Error",
)


def set_write_deadline(sock: socket.socket, timeout_s: float) -> bool:
    """Reset the connection when data stays unacknowledged (or unsent behind a zero
    window) for ``timeout_s`` (``TCP_USER_TIMEOUT``, RFC 5482; Linux). False where the
    platform or socket does not support it."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, max(1, round(timeout_s * 1000)))
    except OSError:
        return False
    return True


class BusyConnections:
    """How many of one server's connections are inside a request now (its head received,
    its response not complete): what ``--max-connections`` bounds."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class HeadMeter:
    """The bytes of one request's head so far, against the bounds; each call returns the
    refusal the head has earned, if any."""

    __slots__ = ("_limits", "num_head_bytes", "num_header_bytes", "num_url_bytes")

    def __init__(self, limits: Http1Limits) -> None:
        self._limits = limits
        self.num_head_bytes = 0  # raw bytes read while in the head
        self.num_header_bytes = 0  # header lines parsed, as on the wire
        self.num_url_bytes = 0

    def begin(self) -> None:
        self.num_head_bytes = self.num_header_bytes = self.num_url_bytes = 0

    def on_data(self, num_bytes: int) -> Refusal | None:
        self.num_head_bytes += num_bytes
        limits = self._limits
        if (
            self.num_head_bytes
            > limits.max_header_bytes + limits.max_url_bytes + _HEAD_READ_SLACK_BYTES
        ):
            return Refusal.HEADERS_TOO_LARGE
        return None

    def on_url(self, num_bytes: int) -> Refusal | None:
        self.num_url_bytes += num_bytes
        if self.num_url_bytes > self._limits.max_url_bytes:
            return Refusal.URL_TOO_LONG
        return None

    def on_header(self, name: bytes, value: bytes) -> Refusal | None:
        self.num_header_bytes += len(name) + len(value) + HEADER_LINE_OVERHEAD
        if self.num_header_bytes > self._limits.max_header_bytes:
            return Refusal.HEADERS_TOO_LARGE
        return None


class RequestBody:
    """A request body as it arrives, bounded: at most ``max_bytes + 1`` bytes are kept."""

    __slots__ = ("_chunks", "_complete", "_max_bytes", "_num_bytes", "_on_read")

    def __init__(self, max_bytes: int, on_read: Callable[[], None]) -> None:
        self._max_bytes = max_bytes
        self._chunks: list[bytes] = []
        self._num_bytes = 0
        self._complete: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._on_read = on_read  # the route began to read (a 100 Continue may be due)

    def feed(self, data: bytes) -> None:
        room = self._max_bytes + 1 - self._num_bytes
        if room > 0:
            kept = data[:room]
            self._chunks.append(kept)
            self._num_bytes += len(kept)

    def complete(self) -> None:
        if not self._complete.done():
            self._complete.set_result(None)

    def lost(self) -> None:
        self._complete.cancel()  # the route reading it is being cancelled too

    async def read(self, max_bytes: int) -> bytes:
        if not self._complete.done():
            self._on_read()
            await self._complete
        body = b"".join(self._chunks)
        return body[: max_bytes + 1]


async def no_body(max_bytes: int) -> bytes:
    """The body of a request whose route reads none."""
    return b""


class ExchangeHost(Protocol):
    """What a :class:`NativeExchange` needs of its connection (one reference per exchange,
    not a bound method per callback: a held stream keeps it for its whole life)."""

    def default_headers(self) -> Sequence[Header]:
        """The server's headers for every response (``date``, ...)."""
        ...

    def log_access(self, scope: Scope | None, status: int) -> None: ...

    def exchange_done(self, keep_alive: bool) -> None:
        """The response is complete (``False``: close the connection after it)."""
        ...

    def exchange_cut(self) -> None:
        """Abort the connection: the response cannot be completed."""
        ...

    def send_continue(self) -> None:
        """The route began to read the body (a ``100 Continue`` may be due)."""
        ...


class NativeExchange:
    """One request answered on the native path, from the end of its head to the end of its
    response. ``host.exchange_done(keep_alive)`` is called once its response is complete
    (``False``: close the connection after it); ``host.exchange_cut()`` when it must be
    aborted instead. Neither is called after :meth:`connection_lost`."""

    __slots__ = (
        "_body",
        "_chunked",
        "_host",
        "_opener",
        "_pending",
        "_route",
        "_scope",
        "_shutting_down",
        "_task",
        "_transport",
        "keep_alive",
        "lost",
        "responded",
        "sse",
    )

    def __init__(
        self,
        route: Route,
        scope: Scope,
        opener: Opener,
        transport: asyncio.Transport,
        *,
        keep_alive: bool,
        chunked: bool,
        host: ExchangeHost,
    ) -> None:
        self._route = route
        self._scope: Scope | None = scope
        self._opener = opener
        self._transport = transport
        self.keep_alive = keep_alive
        self._chunked = chunked
        self._host = host
        # Only while a route reads it: a held stream keeps no body (nor its future).
        self._body: RequestBody | None = (
            RequestBody(opener.limits.max_body_bytes, host.send_continue)
            if route.takes_body
            else None
        )
        self._task: asyncio.Task[None] | None = None
        self._shutting_down = False
        # Body bytes for the opener's write batch (write_batch.py), written at the end of
        # the loop pass or before anything this exchange writes directly.
        self._pending: list[bytes] = []
        self.sse: CallbackSSE | None = None
        self.lost = False  # the client left, or the connection gave up on the exchange
        self.responded = False  # its response head is written

    def start(self, spawn: Callable[[asyncio.Task[None]], None]) -> None:
        """Ask the route for the answer in a task (``spawn`` adopts it: the server waits for
        its tasks when it stops)."""
        self._task = asyncio.get_running_loop().create_task(self._answer())
        spawn(self._task)

    # -- the request -------------------------------------------------------------------

    def feed_body(self, data: bytes) -> None:
        if self._body is not None:
            self._body.feed(data)

    def body_complete(self) -> None:
        if self._body is not None:
            self._body.complete()

    def stop_keep_alive(self) -> None:
        """Close the connection after this response (its head may still be to write)."""
        self.keep_alive = False

    async def _answer(self) -> None:
        try:
            body = self._body
            scope = self._scope or {}
            answer = await self._route.answer(scope, no_body if body is None else body.read)
        except Exception:
            logger.exception("the answer to %s %s failed", scope.get("method"), scope.get("path"))
            answer = INTERNAL_ERROR
            self.keep_alive = False
        self._task = None
        self._body = None  # the route is done with it
        self.write(answer)

    # -- the response ------------------------------------------------------------------

    def write(self, answer: Answer) -> None:
        """Write ``answer`` (the route's, or a refusal of the protocol's own)."""
        if self.lost or self._transport.is_closing():
            if isinstance(answer, Streamed):
                answer.reader.close()  # the client left while we decided
            return
        if isinstance(answer, Whole):
            self._head(answer.status, answer.with_length(), chunked=False)
            if answer.body:
                self._transport.write(answer.body)
            self._host.exchange_done(self.keep_alive)
            return
        self._head(200, [*SSE_HEADERS, *answer.headers], chunked=self._chunked)
        options = self._opener.delivery
        self.sse = CallbackSSE(
            Delivery(answer.reader, answer.frames, options),
            write=self._write_body,
            finish=self._stream_done,
        )
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            set_write_deadline(sock, kernel_write_deadline_s(options))
        # The request is fully handled: drop its scope for the life of a possibly hours-long
        # stream (the next request on this connection makes a new one).
        self._scope = None
        self.sse.start()
        if self._shutting_down and self.sse is not None:
            self.sse.interrupt()

    def _head(self, status: int, headers: list[Header], *, chunked: bool) -> None:
        self._host.log_access(self._scope, status)
        self.responded = True
        self._transport.write(
            response_head(
                status,
                [*self._host.default_headers(), *headers],
                chunked=chunked,
                keep_alive=self.keep_alive,
            )
        )

    def _write_body(self, body: bytes) -> None:
        """Queue ``body`` (a chunk, or raw bytes for a client without chunked coding) for
        the write batch."""
        if not self._pending:
            self._opener.writes.add(self)
        self._pending.append(chunk(body) if self._chunked else body)

    def flush(self) -> None:
        """Write what is pending (the write batch's call, or before a direct write)."""
        pending = self._pending
        if not pending:
            return
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        if not self.lost and not self._transport.is_closing():
            self._transport.write(data)

    def _stream_done(self, clean: bool) -> None:
        self.sse = None
        if clean:
            self.flush()
        else:
            self._pending.clear()  # a stuck or interrupted peer gets no more
        if self.lost or self._transport.is_closing():
            return
        if not clean:  # a stuck or interrupted peer: drop what it did not take, and the socket
            self._host.exchange_cut()
            return
        if self._chunked:
            self._transport.write(LAST_CHUNK)
        self._host.exchange_done(self.keep_alive and self._chunked)

    # -- what the connection reports ---------------------------------------------------

    def pause_writing(self) -> None:
        if self.sse is not None:
            self.sse.pause_writing()

    def resume_writing(self) -> None:
        if self.sse is not None:
            self.sse.resume_writing()

    def shutdown(self) -> None:
        """The server is stopping: end the stream on an event boundary (one still being
        opened is interrupted as soon as it starts); no keep-alive after it."""
        self._shutting_down = True
        self.keep_alive = False
        if self.sse is not None:
            self.sse.interrupt()

    def abandon(self) -> None:
        """Give up before answering (the body did not arrive in time): the answer being
        made is cancelled and nothing is written."""
        self.connection_lost()

    def connection_lost(self) -> None:
        self.lost = True
        self._pending.clear()
        if self._body is not None:
            self._body.lost()
        if self._task is not None:
            self._task.cancel()  # the answer's own cleanup closes its reader
            self._task = None
        if self.sse is not None:
            self.sse.connection_lost()
            self.sse = None
