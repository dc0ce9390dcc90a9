"""A reader: one client's position in one stream's log.

A reader replays the log after its position and then follows it live. It never blocks the
producer or other readers: it only reads what the log retains. Closing it tells the hub the
reader left (which may cancel the stream or start its grace window).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sluice.events import is_terminal
from sluice.streams.log import Batch, EventLog, Waiter

__all__ = ["DeliveryObserver", "Framer", "Reader"]


class DeliveryObserver(Protocol):
    """Told what a transport did to a reader's client, for metrics; quick and never raising."""

    def send_timed_out(self) -> None:
        """The client's socket did not drain for the send timeout: it was disconnected."""

    def coalesced_events(self, count: int) -> None:
        """``count`` token events were merged into others for a lagging client."""

    def token_write_gap(self, model: str, gap_s: float) -> None:
        """A write carrying token events reached a client's socket ``gap_s`` after the
        previous such write to the same connection (one call per write, not per event)."""


class Framer(Protocol):
    """Turns a reader's records into the bytes of a non-native dialect's SSE frames."""

    def frame(self, batch: Batch) -> bytes:
        """The frames of ``batch``'s events, in order (may be empty)."""
        ...

    def refusal(self, code: str, message: str) -> bytes:
        """A terminal in-band error outside the log (for example ``resume_gap``)."""
        ...


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
        "framer",
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
        self.done = False  # the terminal event has been read
        self.interrupted = False  # the server asked this connection to drop (clients resume)
        # Renders batches in a dialect other than the native one (the log's own frames).
        self.framer: Framer | None = None
        # Where the transport reports timeouts and coalescing (the hub's observer).
        self.delivery: DeliveryObserver | None = None
        self._waiter: Waiter | None = None
        self._on_close = on_close
        self._closed = False

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

    def interrupt(self) -> None:
        """Ask the connection to end now, without the terminal event, so its client resumes."""
        self.interrupted = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        """Detach from the stream (idempotent)."""
        if not self._closed:
            self._closed = True
            self._on_close(self)
