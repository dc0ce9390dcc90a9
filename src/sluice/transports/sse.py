"""Server-Sent Events delivery: one reader's records to one HTTP response.

Two drivers share the same wire output (``retry:`` hint first, frames encoded once at
append and joined per write, ``: ping`` when idle, end after the terminal event):

- :class:`SSEConnection` writes straight to an asyncio transport and is driven by
  callbacks: the log resolves a future when records arrive, a timer handles heartbeats,
  the protocol reports flow control and disconnects. No task, queue or buffer per
  connection: a held idle stream costs this object, one pending future and one timer.
  ``sluice serve`` uses it through :mod:`sluice.gateway.protocol`.
- :func:`send_event_stream` is the same loop as a plain ASGI coroutine, for any ASGI
  server.

A reader whose client cannot keep up is simply not read: the log absorbs the gap, and
when the transport drains the next write carries every frame that is ready.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sluice.dialects import native
from sluice.errors import ResumeGapError, StreamNotFoundError
from sluice.sse import encode_comment, encode_retry
from sluice.streams.reader import Reader
from sluice.transports.asgi import Receive, Send

__all__ = ["SSE_HEADERS", "SSEConnection", "SSEOptions", "send_event_stream"]

SSE_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)

_PING = encode_comment("ping")

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

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be positive")
        if self.retry_ms < 0:
            raise ValueError("retry_ms must not be negative")
        if self.max_batch_records < 1:
            raise ValueError("max_batch_records must be at least 1")


def _next_body(reader: Reader, max_records: int) -> bytes | None:
    """The bytes to write next for ``reader``: ready frames, a refusal, or ``None``.

    Sets ``reader.done`` when the body ends the stream (terminal event, resume gap, or a
    log that expired underneath).
    """
    framer = reader.framer
    try:
        batch = reader.read(max_records)
    except ResumeGapError as exc:
        reader.done = True
        if framer is not None:
            return framer.refusal("resume_gap", str(exc))
        return native.error_frame("resume_gap", str(exc))
    except StreamNotFoundError:
        reader.done = True  # expired under us: nothing more will come
        return b""
    frames = batch.frames
    if not frames:
        return None
    if framer is not None:
        return framer.frame(batch)
    return frames[0] if len(frames) == 1 else b"".join(frames)


class SSEConnection:
    """One SSE response body written to ``write`` as the reader's records arrive.

    ``write`` takes body bytes (the HTTP layer frames them: chunked or raw); ``finish``
    is called once, with ``True`` when the response ended cleanly (the HTTP layer may
    keep the connection) and ``False`` when it must be closed.
    """

    __slots__ = (
        "_finish",
        "_heartbeat",
        "_last_write",
        "_loop",
        "_options",
        "_paused",
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
        self._last_write = 0.0
        self._paused = False
        self.closed = False

    def start(self) -> None:
        """Write the ``retry:`` hint and everything ready, then follow the log."""
        if self.reader.framer is None:  # see _RETRY_NATIVE_ONLY
            self._write(encode_retry(self._options.retry_ms))
        self._last_write = self._loop.time()
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
            body = _next_body(reader, max_records)
            if body is None:
                self._watching = True
                reader.watch(self)
                return
            if body:
                self._write(body)
                self._last_write = self._loop.time()
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
        idle_s = self._loop.time() - self._last_write
        if idle_s >= interval_s and not self._paused:
            self._write(_PING)
            self._last_write = self._loop.time()
            idle_s = 0.0
        self._heartbeat = self._loop.call_later(interval_s - idle_s, self._on_heartbeat)

    def pause_writing(self) -> None:
        """The transport's buffer is full: stop reading the log until it drains."""
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if not self.closed:
            self._pump()

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
    loop = asyncio.get_running_loop()
    # Owned by this coroutine and cancelled in ``finally``: it only waits for the peer to go.
    disconnect = asyncio.ensure_future(_until_disconnect(receive))
    wakeup = _Wakeup()
    disconnect.add_done_callback(wakeup.fire)
    timer: asyncio.TimerHandle | None = None
    try:
        headers = [*SSE_HEADERS, *extra_headers]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if reader.framer is None:  # see _RETRY_NATIVE_ONLY
            retry = encode_retry(options.retry_ms)
            await send({"type": "http.response.body", "body": retry, "more_body": True})
        last_write = loop.time()
        heartbeat_s = options.heartbeat_interval_s
        while not disconnect.done() and not reader.interrupted:
            body = _next_body(reader, options.max_batch_records)
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})
                last_write = loop.time()
            if reader.done:
                break
            if body is not None:
                continue
            idle_s = loop.time() - last_write
            if idle_s >= heartbeat_s:
                await send({"type": "http.response.body", "body": _PING, "more_body": True})
                last_write = loop.time()
                idle_s = 0.0
            future: asyncio.Future[None] = loop.create_future()
            wakeup.future = future
            reader.watch(future)
            timer = loop.call_later(heartbeat_s - idle_s, _resolve, future)
            try:
                await future
            finally:
                timer.cancel()
                timer = None
                wakeup.future = None
                reader.unwatch(future)
        if not disconnect.done():
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        if timer is not None:
            timer.cancel()
        reader.close()
        disconnect.cancel()
