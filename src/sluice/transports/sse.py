"""Server-Sent Events delivery: one reader's records to one HTTP response.

Two drivers share the same wire output (``retry:`` hint first, frames encoded once at
append and joined per write, a ``: ping`` comment line when idle, end after the terminal
event):

- :class:`SSEConnection` writes straight to an asyncio transport and is driven by
  callbacks: the log resolves a future when records arrive, a timer handles heartbeats,
  the protocol reports flow control and disconnects. No task, queue or buffer per
  connection: a held idle stream costs this object, one pending future and one timer.
  ``sluice serve`` uses it through :mod:`sluice.gateway.protocol`.
- :func:`send_event_stream` is the same loop as a plain ASGI coroutine, for any ASGI
  server.

Each write that carries token events reports the gap since the previous one to the
reader's :class:`~sluice.streams.reader.DeliveryObserver` (``token_write_gap``), after the
write: the clock read that stamps a write for heartbeats serves it too.

A reader whose client cannot keep up is simply not read: the log absorbs the gap, and
when the transport drains the next write carries every frame that is ready. Slow clients:

- **Coalescing.** A connection whose transport had to pause (the native path) or whose
  last send had to wait (the ASGI path) is *lagging* until it catches up with the log;
  while lagging, each run of consecutive ``token`` events in a read is sent as ONE
  ``token`` event carrying their concatenated text, with the id of the last of them, so a
  resume from that id is still exact. Native dialect only: the compatible dialects'
  frames are rendered per event by their framers and left as they are. A client that keeps
  up sees one event per token, exactly as appended.
- **Send timeout.** A connection whose socket has not drained for ``send_timeout_s`` is
  closed (unclean: no terminal event; the client may resume). Closing detaches its
  reader, so a non-resumable stream left without readers is cancelled by the hub and no
  model slot stays pinned by a stuck client. The native path arms one timer when the
  transport pauses (nothing per write); the ASGI path puts each ``send`` under a deadline.
- **Dead peers** (half-open TCP) never fill the buffer with heartbeats alone, so the
  deadline that catches them is the kernel's: :func:`set_write_deadline` sets
  ``TCP_USER_TIMEOUT`` to ``send_timeout_s`` on the connection's socket (data, such as the
  next ``: ping``, unacknowledged that long resets the connection). With the defaults
  (15 s heartbeats, 30 s timeout) a vanished peer is dropped within about two heartbeat
  intervals after the first unanswered ping.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sluice.dialects import native
from sluice.errors import ResumeGapError, StreamNotFoundError
from sluice.events import NeutralEvent, TextDelta, ToolCallDelta
from sluice.sse import encode_comment, encode_retry
from sluice.streams.ids import event_id
from sluice.streams.log import Batch
from sluice.streams.reader import Reader
from sluice.transports.asgi import Receive, Send

__all__ = [
    "SSE_HEADERS",
    "SSEConnection",
    "SSEOptions",
    "coalesce_tokens",
    "send_event_stream",
    "set_write_deadline",
]

SSE_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)

# ``: ping\n``, a bare comment line: no blank line follows it, so no SSE parser (the SDKs'
# included) dispatches an empty event for it (see :mod:`sluice.sse.encoder`, choice 6).
# Frames are whole blocks, so a ping is always written where a line begins.
_PING = encode_comment("ping")

# An ASGI ``send`` that returns later than this waited for the socket to drain (a send that
# does not wait returns within microseconds): the reader is lagging.
_SEND_WAITED_S = 0.002

# _RETRY_NATIVE_ONLY: the ``retry:`` hint goes to native streams only. The OpenAI and
# Anthropic SDKs' SSE parsers turn a ``retry:``-only block into an event with empty data
# and fail to parse it as JSON; their clients do not reconnect by themselves anyway.


@dataclass(frozen=True, slots=True)
class SSEOptions:
    """How one SSE response behaves."""

    # Below the 30-60 s idle timeouts of common proxies and load balancers.
    heartbeat_interval_s: float = 15.0
    # The reconnection delay EventSource should use after a drop.
    retry_ms: int = 1000
    # Frames joined into one write when a reader is behind (bounds a single write's size).
    max_batch_records: int = 512
    # A connection whose socket takes nothing for this long is closed (it may resume):
    # two default heartbeat intervals, under the 60 s idle timeouts of common proxies.
    send_timeout_s: float = 30.0
    # Merge a lagging reader's consecutive token events (native dialect; see above).
    coalesce: bool = True

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be positive")
        if self.retry_ms < 0:
            raise ValueError("retry_ms must not be negative")
        if self.max_batch_records < 1:
            raise ValueError("max_batch_records must be at least 1")
        if not self.send_timeout_s > 0:
            raise ValueError("send_timeout_s must be positive")


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


def coalesce_tokens(batch: Batch, stream_id: str) -> tuple[bytes, int]:
    """The native frames of ``batch`` with each run of consecutive ``TextDelta`` events
    sent as one ``token`` event: their texts joined, the id of the run's last event.

    Returns the bytes and how many events were merged away. A run of one keeps its frame
    as appended. Resuming from a merged event's id replays exactly what followed the run.
    """
    events, frames = batch.events, batch.frames
    parts: list[bytes] = []
    run: list[str] = []
    num_merged = 0
    first_seq = batch.first_seq
    for index, event in enumerate(events):
        if type(event) is TextDelta:
            run.append(event.text)
            continue
        if run:
            num_merged += _flush_run(parts, run, frames, index - 1, stream_id, first_seq)
        parts.append(frames[index])
    if run:
        num_merged += _flush_run(parts, run, frames, len(events) - 1, stream_id, first_seq)
    return b"".join(parts), num_merged


def _flush_run(
    parts: list[bytes],
    run: list[str],
    frames: Sequence[bytes],
    last: int,
    stream_id: str,
    first_seq: int,
) -> int:
    num_merged = len(run) - 1
    if num_merged:
        merged = TextDelta("".join(run))
        parts.append(native.frame(merged, event_id(stream_id, first_seq + last)))
    else:
        parts.append(frames[last])
    run.clear()
    return num_merged


def _has_tokens(events: Sequence[NeutralEvent]) -> bool:
    """Whether ``events`` holds a token event. A stream's token events are contiguous
    after its one ``Started``, so the scan of a read with tokens stops at its first or
    second event."""
    for event in events:
        kind = type(event)
        if kind is TextDelta or kind is ToolCallDelta:
            return True
    return False


def _next_body(
    reader: Reader, max_records: int, lagging: bool = False
) -> tuple[bytes | None, bool]:
    """The bytes to write next for ``reader`` (ready frames, a refusal, or ``None``), and
    whether they carry token events (only worked out when the reader has an observer).

    Sets ``reader.done`` when the body ends the stream (terminal event, resume gap, or a
    log that expired underneath). A ``lagging`` native reader's token runs are coalesced.
    """
    framer = reader.framer
    try:
        batch = reader.read(max_records)
    except ResumeGapError as exc:
        reader.done = True
        if framer is not None:
            return framer.refusal("resume_gap", str(exc)), False
        position = event_id(reader.stream_id, exc.after_seq)  # its reconnect then gets 410
        return native.error_frame("resume_gap", str(exc), event_id=position), False
    except StreamNotFoundError:
        reader.done = True  # expired under us: nothing more will come
        return b"", False
    frames = batch.frames
    if not frames:
        return None, False
    delivery = reader.delivery
    tokens = delivery is not None and _has_tokens(batch.events)
    if framer is not None:
        return framer.frame(batch), tokens
    if len(frames) == 1:
        return frames[0], tokens
    if lagging:
        body, num_merged = coalesce_tokens(batch, reader.stream_id)
        if num_merged and delivery is not None:
            delivery.coalesced_events(num_merged)
        return body, tokens
    return b"".join(frames), tokens


class SSEConnection:
    """One SSE response body written to ``write`` as the reader's records arrive.

    ``write`` takes body bytes (the HTTP layer frames them: chunked or raw); ``finish``
    is called once, with ``True`` when the response ended cleanly (the HTTP layer may
    keep the connection) and ``False`` when it must be closed.
    """

    __slots__ = (
        "_finish",
        "_heartbeat",
        "_lagging",
        "_last_token_write",
        "_last_write",
        "_loop",
        "_options",
        "_paused",
        "_stall",
        "_watching",
        "_write",
        "closed",
        "reader",
    )

    def __init__(
        self,
        reader: Reader,
        options: SSEOptions,
        *,
        write: Callable[[bytes], None],
        finish: Callable[[bool], None],
    ) -> None:
        self.reader = reader
        self._options = options
        self._write = write
        self._finish = finish
        self._loop = asyncio.get_running_loop()
        self._watching = False  # registered with the log as its waiter
        self._heartbeat: asyncio.TimerHandle | None = None
        self._last_write = 0.0  # time.monotonic() of the last write
        self._last_token_write = 0.0  # ... of the last write with token events (0: none)
        self._paused = False
        self._lagging = False  # paused since it last caught up with the log: coalesce
        self._stall: asyncio.TimerHandle | None = None  # the send timeout while paused
        self.closed = False

    def start(self) -> None:
        """Write the ``retry:`` hint and everything ready, then follow the log."""
        if self.reader.framer is None:  # see _RETRY_NATIVE_ONLY
            self._write(encode_retry(self._options.retry_ms))
        self._last_write = time.monotonic()
        self._heartbeat = self._loop.call_later(
            self._options.heartbeat_interval_s, self._on_heartbeat
        )
        self._pump()

    def _pump(self) -> None:
        if self._watching:
            return
        reader = self.reader
        max_records = self._options.max_batch_records
        while not self.closed and not self._paused:
            if reader.interrupted:
                self._end(clean=True)
                return
            body, tokens = _next_body(reader, max_records, self._lagging)
            if body is None:
                self._lagging = False  # caught up
                self._watching = True
                reader.watch(self)
                return
            if body:
                self._write(body)
                self._last_write = now = time.monotonic()
                if tokens:  # the edge-side gap, after the write (tokens: an observer)
                    if self._last_token_write and reader.delivery is not None:
                        reader.delivery.token_write_gap(reader.model, now - self._last_token_write)
                    self._last_token_write = now
            if reader.done:
                self._end(clean=True)
                return

    # The log's Waiter protocol: the connection is its own waiter, so an idle stream holds
    # no future. It writes at once, inside the producer's append: a token reaches the
    # socket in the same loop pass it was produced in, and a burst appended together goes
    # out in one write.

    def done(self) -> bool:
        return not self._watching

    def set_result(self, result: None, /) -> None:
        if self._watching:
            self._watching = False
            self._pump()

    def _on_heartbeat(self) -> None:
        if self.closed:
            return
        interval_s = self._options.heartbeat_interval_s
        idle_s = time.monotonic() - self._last_write
        if idle_s >= interval_s and not self._paused:
            self._write(_PING)
            self._last_write = time.monotonic()
            idle_s = 0.0
        self._heartbeat = self._loop.call_later(interval_s - idle_s, self._on_heartbeat)

    def pause_writing(self) -> None:
        """The transport's buffer is full: stop reading the log until it drains, and close
        the connection if it does not drain within ``send_timeout_s``."""
        if self._paused or self.closed:
            return
        self._paused = True
        self._lagging = self._options.coalesce
        self._stall = self._loop.call_later(self._options.send_timeout_s, self._on_stalled)

    def resume_writing(self) -> None:
        self._paused = False
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if not self.closed:
            self._pump()

    def _on_stalled(self) -> None:
        self._stall = None
        if self.closed or not self._paused:
            return
        delivery = self.reader.delivery
        if delivery is not None:
            delivery.send_timed_out()
        self._end(clean=False)  # the reader leaves: a non-resumable stream is cancelled

    def interrupt(self) -> None:
        """End the response now, on an event boundary (server shutdown, drop)."""
        self.reader.interrupt()
        if self._paused and not self.closed:
            self._end(clean=False)

    def connection_lost(self) -> None:
        """The peer is gone: detach without writing anything."""
        self._release()

    def _end(self, *, clean: bool) -> None:
        self._release()
        self._finish(clean)

    def _release(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._watching:
            self._watching = False
            self.reader.unwatch(self)
        self.reader.close()


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class _Wakeup:
    """The one future a waiting ASGI connection sleeps on; anything may resolve it."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future[None] | None = None

    def fire(self, _: object = None) -> None:
        _resolve(self.future)


async def send_event_stream(
    receive: Receive,
    send: Send,
    reader: Reader,
    options: SSEOptions,
    *,
    extra_headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Stream ``reader``'s records as a plain ASGI SSE response until the end or a disconnect."""
    # Owned by this coroutine and cancelled in ``finally``: it only waits for the peer to go.
    disconnect = asyncio.ensure_future(_until_disconnect(receive))
    wakeup = _Wakeup()
    disconnect.add_done_callback(wakeup.fire)
    try:
        async with asyncio.timeout(None) as deadline:
            await _stream_body(send, reader, options, extra_headers, disconnect, wakeup, deadline)
    except TimeoutError:
        # A send waited ``send_timeout_s`` for the socket to drain: give up on the client
        # (it may resume). ASGI cannot abort a response, so return without completing it:
        # the server closes the connection (uvicorn logs that the response was incomplete).
        if reader.delivery is not None:
            reader.delivery.send_timed_out()
    finally:
        reader.close()
        disconnect.cancel()


async def _stream_body(
    send: Send,
    reader: Reader,
    options: SSEOptions,
    extra_headers: Iterable[tuple[bytes, bytes]],
    disconnect: asyncio.Future[None],
    wakeup: _Wakeup,
    deadline: asyncio.Timeout,
) -> None:
    """The response of :func:`send_event_stream`; every ``send`` runs under ``deadline``."""
    loop = asyncio.get_running_loop()
    send_timeout_s = options.send_timeout_s

    async def send_body(body: bytes, more_body: bool = True) -> bool:
        """Send under the deadline; True when the send had to wait for the socket."""
        before = loop.time()
        deadline.reschedule(before + send_timeout_s)
        await send({"type": "http.response.body", "body": body, "more_body": more_body})
        deadline.reschedule(None)
        return loop.time() - before > _SEND_WAITED_S

    headers = [*SSE_HEADERS, *extra_headers]
    deadline.reschedule(loop.time() + send_timeout_s)
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    deadline.reschedule(None)
    if reader.framer is None:  # see _RETRY_NATIVE_ONLY
        await send_body(encode_retry(options.retry_ms))
    last_write = time.monotonic()
    last_token_write = 0.0  # time.monotonic() of the last write with token events
    heartbeat_s = options.heartbeat_interval_s
    lagging = False  # a send had to wait since the reader last caught up: coalesce
    while not disconnect.done() and not reader.interrupted:
        body, tokens = _next_body(reader, options.max_batch_records, lagging)
        if body:
            if await send_body(body) and options.coalesce:
                lagging = True
            last_write = now = time.monotonic()
            if tokens:  # the edge-side gap, after the write (tokens: an observer)
                if last_token_write and reader.delivery is not None:
                    reader.delivery.token_write_gap(reader.model, now - last_token_write)
                last_token_write = now
        if reader.done:
            break
        if body is not None:
            continue
        lagging = False  # caught up
        idle_s = time.monotonic() - last_write
        if idle_s >= heartbeat_s:
            await send_body(_PING)
            last_write = time.monotonic()
            idle_s = 0.0
        future: asyncio.Future[None] = loop.create_future()
        wakeup.future = future
        reader.watch(future)
        timer = loop.call_later(heartbeat_s - idle_s, _resolve, future)
        try:
            await future
        finally:
            timer.cancel()
            wakeup.future = None
            reader.unwatch(future)
    if not disconnect.done():
        await send_body(b"", more_body=False)
