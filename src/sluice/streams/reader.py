"""A reader: one client's position in one stream's log.

A reader replays the log after its position and then follows it live. It never blocks the
producer or other readers: it only reads what the log retains. Closing it tells the hub the
reader left (which may cancel the stream or start its grace window).

Two ways to follow the log, one mechanism: a callback-driven connection is its own
:class:`~sluice.streams.log.Waiter` (:meth:`Reader.watch`, no future while idle); a
coroutine awaits :meth:`Reader.wait` or iterates :meth:`Reader.batches`. "Read, else wait
for the log" is written here once (:func:`wait_for_record`), for readers and for the hub.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from sluice.events import is_terminal
from sluice.streams.log import Batch, EventLog, Waiter

__all__ = ["DeliveryObserver", "Reader", "wait_for_record"]


class DeliveryObserver(Protocol):
    """Told what a transport did to a reader's client, for metrics; quick and never raising."""

    def send_timed_out(self) -> None:
        """The client's socket did not drain for the send timeout: it was disconnected."""

    def coalesced_events(self, count: int) -> None:
        """``count`` token events were merged into others for a lagging client."""

    def token_write_gap(self, model: str, gap_s: float) -> None:
        """A write carrying token events reached a client's socket ``gap_s`` after the
        previous such write to the same connection (one call per write, not per event)."""


async def wait_for_record(
    log: EventLog, stream_id: str, after_seq: int, timeout_s: float | None = None
) -> bool:
    """Wait until the log holds a record after ``after_seq`` (or the stream's log is
    gone); False when ``timeout_s`` passed first. One future, watched and unwatched here."""
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    log.watch(stream_id, after_seq, waiter)
    try:
        async with asyncio.timeout(timeout_s):
            await waiter
    except TimeoutError:
        return False
    finally:
        log.unwatch(stream_id, waiter)
    return True


class Reader:
    """Reads one stream's records in order, without gap or duplicate."""

    __slots__ = (
        "_closed",
        "_log",
        "_on_close",
        "_waiter",
        "after_seq",
        "delivery",
        "done",
        "interrupted",
        "model",
        "stream_id",
    )

    def __init__(
        self,
        log: EventLog,
        stream_id: str,
        after_seq: int,
        *,
        on_close: Callable[[Reader], None],
        model: str = "",
    ) -> None:
        self._log = log
        self.stream_id = stream_id
        self.model = model  # the stream's model, for the delivery observer's labels
        self.after_seq = after_seq
        self.done = False  # the terminal event has been read (or nothing more can come)
        self.interrupted = False  # the server asked this connection to drop (clients resume)
        # Where the transport reports timeouts and coalescing (the hub's observer).
        self.delivery: DeliveryObserver | None = None
        self._waiter: Waiter | None = None
        self._on_close = on_close
        self._closed = False

    @property
    def log(self) -> EventLog:
        return self._log

    def read(self, max_records: int) -> Batch:
        """The next records after the reader's position (possibly none); advances it."""
        batch = self._log.read(self.stream_id, self.after_seq, max_records)
        if batch.events:
            self.after_seq = batch.last_seq
            if is_terminal(batch.events[-1]):
                self.done = True
        return batch

    def watch(self, waiter: Waiter) -> None:
        """Resolve ``waiter`` when a record after the reader's position exists."""
        self._waiter = waiter
        self._log.watch(self.stream_id, self.after_seq, waiter)

    def unwatch(self, waiter: Waiter) -> None:
        self._waiter = None
        self._log.unwatch(self.stream_id, waiter)

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until a record after the reader's position exists, the log is gone, or the
        reader is woken (:meth:`wake`, :meth:`interrupt`); False when ``timeout_s`` passed
        first."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.watch(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            return False
        finally:
            self.unwatch(waiter)
        return True

    async def batches(self, max_records: int) -> AsyncIterator[Batch]:
        """Every batch up to the terminal event, waiting for the log in between; ends early
        when the reader is interrupted. Raises what :meth:`read` raises."""
        while not self.done:
            batch = self.read(max_records)
            if batch.events:
                yield batch
            elif self.interrupted:
                return
            else:
                await self.wait()

    def wake(self) -> None:
        """Resolve the waiter the reader is watching with now, if any (the caller has
        something else to look at: a client gone, a shutdown)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def interrupt(self) -> None:
        """Ask the connection to end now, without the terminal event, so its client resumes."""
        self.interrupted = True
        self.wake()

    def close(self) -> None:
        """Detach from the stream (idempotent)."""
        if not self._closed:
            self._closed = True
            self._on_close(self)

    @property
    def closed(self) -> bool:
        return self._closed
