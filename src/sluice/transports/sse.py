"""Server-Sent Events delivery: one reader's records to one HTTP response, as plain ASGI.

The loop per connection:

1. send the response head (headers go out at once) and a ``retry:`` hint;
2. read every record the log holds after the reader's position (up to a batch bound) and
   write their frames, encoded once at append, joined in one ``send``;
3. when nothing is ready, wait on a single future that the log resolves on append, a timer
   resolves for the next heartbeat, or the disconnect watcher resolves when the peer leaves;
4. stop after the terminal event, a resume gap, or a disconnect; always detach the reader.

Per connection this holds one coroutine, one future while idle, one timer handle and the
disconnect watcher: no queues, no buffers beyond the batch being written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from sluice.dialects import native
from sluice.errors import ResumeGapError, StreamNotFoundError
from sluice.sse import encode_comment, encode_retry
from sluice.streams.reader import Reader
from sluice.transports.asgi import Receive, Send

__all__ = ["SSE_HEADERS", "SSEOptions", "send_event_stream"]

SSE_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)

_PING = encode_comment("ping")


@dataclass(frozen=True, slots=True)
class SSEOptions:
    """How one SSE response behaves."""

    # Below the 30-60 s idle timeouts of common proxies and load balancers.
    heartbeat_interval_s: float = 15.0
    # The reconnection delay EventSource should use after a drop.
    retry_ms: int = 1000
    # Frames joined into one write when a reader is behind (bounds a single send's size).
    max_batch_records: int = 512

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be positive")
        if self.retry_ms < 0:
            raise ValueError("retry_ms must not be negative")
        if self.max_batch_records < 1:
            raise ValueError("max_batch_records must be at least 1")


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class _Wakeup:
    """The one future a waiting connection sleeps on; anything may resolve it."""

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
    """Stream ``reader``'s records as an SSE response until the end or a disconnect."""
    loop = asyncio.get_running_loop()
    # Owned by this coroutine and cancelled in ``finally``: it only waits for the peer to go.
    disconnect = asyncio.ensure_future(_until_disconnect(receive))
    wakeup = _Wakeup()
    disconnect.add_done_callback(wakeup.fire)
    timer: asyncio.TimerHandle | None = None
    try:
        headers = [*SSE_HEADERS, *extra_headers]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send(
            {
                "type": "http.response.body",
                "body": encode_retry(options.retry_ms),
                "more_body": True,
            }
        )
        last_write = loop.time()
        heartbeat_s = options.heartbeat_interval_s
        max_batch = options.max_batch_records
        while not disconnect.done() and not reader.interrupted:
            try:
                batch = await reader.read(max_batch)
            except ResumeGapError as exc:
                body = native.error_frame("resume_gap", str(exc))
                await send({"type": "http.response.body", "body": body, "more_body": True})
                break
            except StreamNotFoundError:
                break  # expired under us: nothing more will come
            if batch.frames:
                frames = batch.frames
                body = frames[0] if len(frames) == 1 else b"".join(frames)
                await send({"type": "http.response.body", "body": body, "more_body": True})
                last_write = loop.time()
                if reader.done:
                    break
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
