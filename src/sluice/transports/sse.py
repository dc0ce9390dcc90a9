"""Server-Sent Events over HTTP: two thin shells around the delivery core.

The core (:class:`~sluice.transports.delivery.Delivery`) decides every byte, heartbeat,
coalesced run and timeout; a shell only moves its bytes and runs its timers:

- :class:`CallbackSSE` writes to a callable (the native HTTP/1.1 path frames the bytes as
  chunks onto its transport) and is driven by callbacks: the log wakes it when records
  arrive (it is the log's waiter: an idle stream holds no future), one loop timer serves
  heartbeats and the send timeout, the protocol reports flow control and disconnects. No
  task, queue or buffer per connection: a held idle stream costs this object, the core
  and one timer.
- :func:`send_event_stream` is the same delivery as a plain ASGI coroutine, for any ASGI
  server, driven by :func:`sluice.transports.awaited.pump` (each ``send`` under the send
  timeout; a send that had to wait for the socket marks the connection lagging); the
  client's disconnect is watched by one task under a task group
  (:mod:`sluice.transports.disconnect`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from sluice.streams.reader import Reader
from sluice.transports.asgi import Receive, Send
from sluice.transports.awaited import pump
from sluice.transports.delivery import Delivery, DeliveryOptions, Ending
from sluice.transports.disconnect import watching_disconnect
from sluice.transports.frames import FrameSource

__all__ = ["SSE_HEADERS", "CallbackSSE", "send_event_stream"]

SSE_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


class CallbackSSE:
    """One SSE response body written to ``write`` as the reader's records arrive.

    ``write`` takes body bytes (the HTTP layer frames them: chunked or raw); ``finish``
    is called once, with ``True`` when the response ended cleanly (the HTTP layer may
    keep the connection) and ``False`` when it must be cut. It is not called after
    :meth:`connection_lost`.
    """

    __slots__ = (
        "_finish",
        "_finished",
        "_loop",
        "_timer",
        "_timer_at",
        "_watching",
        "_write",
        "core",
    )

    def __init__(
        self,
        core: Delivery,
        *,
        write: Callable[[bytes], None],
        finish: Callable[[bool], None],
    ) -> None:
        self.core = core
        self._write = write
        self._finish = finish
        self._loop = asyncio.get_running_loop()
        self._watching = False  # registered with the log as its waiter
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._finished = False

    @property
    def closed(self) -> bool:
        return self.core.ended is not None

    def start(self) -> None:
        """Write the ``retry:`` hint and everything ready, then follow the log."""
        core = self.core
        data = core.start(time.monotonic())
        self._arm()
        self._drive(data)

    def _drive(self, data: bytes) -> None:
        """Write ``data``, then whatever else is ready, until the core waits, pauses or ends."""
        core = self.core
        while True:
            if data:
                self._write(data)  # may pause the transport (and so the core) at once
            if core.ended is not None:
                self._done()
                return
            if core.paused:
                return
            if core.waiting:
                if not self._watching:
                    self._watching = True
                    core.reader.watch(self)
                return
            data = core.on_records(time.monotonic())

    # The log's Waiter protocol: the connection is its own waiter, so an idle stream holds
    # no future. It writes at once, inside the producer's append: a token reaches the
    # socket in the same loop pass it was produced in, and a burst appended together goes
    # out in one write.

    def done(self) -> bool:
        return not self._watching

    def set_result(self, result: None, /) -> None:
        if self._watching:
            self._watching = False
            self._drive(self.core.on_records(time.monotonic()))

    # -- timers ------------------------------------------------------------------------

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        at = self.core.wake_at
        self._timer_at = at
        self._timer = self._loop.call_later(max(0.0, at - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        core = self.core
        if core.ended is not None:
            return
        data = core.on_timer(time.monotonic())
        if core.ended is None:
            self._arm()
        self._drive(data)

    # -- what the HTTP layer reports ---------------------------------------------------

    def pause_writing(self) -> None:
        """The transport's buffer is full: stop reading the log until it drains, and end
        the connection if it does not drain within the send timeout."""
        core = self.core
        core.on_paused(time.monotonic())
        if core.ended is None and core.wake_at < self._timer_at:
            self._arm()

    def resume_writing(self) -> None:
        core = self.core
        core.on_resumed(time.monotonic())
        if core.ended is None and not self._watching:
            self._drive(b"")

    def interrupt(self) -> None:
        """End the response now, on an event boundary (server shutdown, drop)."""
        self.core.interrupt()
        if self.core.ended is not None:
            self._done()

    def connection_lost(self) -> None:
        """The peer is gone: detach without writing anything."""
        self._finished = True
        self.core.close()
        self._release()

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watching:
            self._watching = False
            self.core.reader.unwatch(self)

    def _done(self) -> None:
        self._release()
        if not self._finished:
            self._finished = True
            self._finish(self.core.ended is Ending.CLEAN)


async def send_event_stream(
    receive: Receive,
    send: Send,
    reader: Reader,
    frames: FrameSource,
    options: DeliveryOptions,
    *,
    extra_headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Stream ``reader``'s records as a plain ASGI SSE response until the end or a disconnect."""
    core = Delivery(reader, frames, options)
    gone = False

    def on_disconnect() -> None:
        nonlocal gone
        gone = True
        reader.wake()

    async def send_body(body: bytes) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": True})

    try:
        async with watching_disconnect(receive, on_disconnect):
            async with asyncio.timeout(options.send_timeout_s):
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [*SSE_HEADERS, *extra_headers],
                    }
                )
            whole = await pump(
                core, send_body, send_timeout_s=options.send_timeout_s, gone=lambda: gone
            )
            if whole:
                async with asyncio.timeout(options.send_timeout_s):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
    except TimeoutError:
        # A send waited ``send_timeout_s`` for the socket to drain: give up on the client
        # (it may resume). ASGI cannot abort a response, so return without completing it:
        # the server closes the connection (uvicorn logs that the response was incomplete).
        core.on_stalled()
    finally:
        core.close()
