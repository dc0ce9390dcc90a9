"""In-process event log: the default store, one Python list of neutral events per stream.

Waiters are futures (or connections) kept in a per-stream list and resolved by the next
append. The log holds events only; an observer (:class:`~sluice.streams.log.LogObserver`,
the delivery layer's frame cache) is told of every append, trim and delete, and what it
keeps beside a record is counted with the record.

Bytes are the estimate of :mod:`sluice.streams.sizing` (the events, plus what the observer
holds beside them), so the per-stream bound and the hub's server-wide budget count what
the process really holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.errors import ResumeGapError, StreamNotFoundError
from sluice.events import NeutralEvent
from sluice.streams.log import Batch, LogLimits, LogObserver, Waiter
from sluice.streams.sizing import LOG_BYTES, event_bytes

__all__ = ["MemoryEventLog"]


class _Log:
    __slots__ = ("events", "first_seq", "num_bytes", "waiters")

    def __init__(self) -> None:
        self.events: list[NeutralEvent] = []
        self.first_seq = 1  # seq of events[0] (or of the next event, when empty)
        self.num_bytes = 0  # of the records (see sluice.streams.sizing), not LOG_BYTES
        self.waiters: list[Waiter] = []


class MemoryEventLog:
    """An :class:`~sluice.streams.log.EventLog` in this process's memory."""

    def __init__(
        self, limits: LogLimits | None = None, observer: LogObserver | None = None
    ) -> None:
        self._limits = limits or LogLimits()
        self._observer = observer
        self._logs: dict[str, _Log] = {}
        self._total_bytes = 0

    def __len__(self) -> int:
        return len(self._logs)

    def _get(self, stream_id: str) -> _Log:
        log = self._logs.get(stream_id)
        if log is None:
            raise StreamNotFoundError(stream_id)
        return log

    async def create(self, stream_id: str) -> None:
        self.open(stream_id)

    def open(self, stream_id: str, first_seq: int = 1) -> None:
        """Create an empty log whose first record will be ``first_seq`` (a mirror of a log
        kept elsewhere starts where that one's retained records start)."""
        if stream_id in self._logs:
            raise ValueError(f"log for {stream_id!r} already exists")
        log = self._logs[stream_id] = _Log()
        log.first_seq = first_seq
        self._total_bytes += LOG_BYTES

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._logs

    async def append(
        self, stream_id: str, events: Sequence[NeutralEvent], *, wait: bool = True
    ) -> int:
        return self.extend(stream_id, events)  # in the log at once, waiting or not

    async def sync(self, stream_id: str) -> None:
        """Every append is in the log when it returns: nothing to wait for."""

    def extend(self, stream_id: str, events: Sequence[NeutralEvent]) -> int:
        """:meth:`append`, synchronously (for a mirror fed by callbacks)."""
        log = self._logs.get(stream_id)
        if log is None:
            raise StreamNotFoundError(stream_id)
        stored = log.events
        first_seq = log.first_seq + len(stored)
        num_bytes = log.num_bytes
        for event in events:
            num_bytes += event_bytes(event)
        stored.extend(events)
        observer = self._observer
        if observer is not None:
            num_bytes += observer.appended(stream_id, first_seq, events)
        self._total_bytes += num_bytes - log.num_bytes
        log.num_bytes = num_bytes
        limits = self._limits
        if len(stored) > limits.max_records or num_bytes > limits.max_bytes:
            # Drop a tenth of the bound more than needed, so trimming is amortised O(1).
            self._trim(
                stream_id,
                log,
                limits.max_records - limits.max_records // 10,
                limits.max_bytes - limits.max_bytes // 10,
            )
        if log.waiters:
            self._wake(log)
        return first_seq + len(events) - 1

    def _record_bytes(self, stream_id: str, log: _Log, index: int) -> int:
        num_bytes = event_bytes(log.events[index])
        if self._observer is not None:
            num_bytes += self._observer.record_bytes(stream_id, log.first_seq + index)
        return num_bytes

    def _trim(self, stream_id: str, log: _Log, keep_records: int, keep_bytes: int) -> None:
        """Drop the oldest records until at most ``keep_records`` of at most ``keep_bytes``
        remain, but never the newest record."""
        events = log.events
        drop = max(0, len(events) - keep_records)
        num_bytes = log.num_bytes
        for i in range(drop):
            num_bytes -= self._record_bytes(stream_id, log, i)
        while drop < len(events) - 1 and num_bytes > keep_bytes:
            num_bytes -= self._record_bytes(stream_id, log, drop)
            drop += 1
        if not drop:
            return
        del events[:drop]
        log.first_seq += drop
        self._total_bytes -= log.num_bytes - num_bytes
        log.num_bytes = num_bytes
        if self._observer is not None:
            self._observer.trimmed(stream_id, log.first_seq)

    def num_bytes(self, stream_id: str) -> int:
        return LOG_BYTES + self._get(stream_id).num_bytes

    @property
    def total_bytes(self) -> int:
        """What every stream's log holds (the sum of :meth:`num_bytes`)."""
        return self._total_bytes

    def trim(self, stream_id: str, max_bytes: int) -> None:
        log = self._get(stream_id)
        self._trim(stream_id, log, len(log.events), max_bytes - LOG_BYTES)

    def read(self, stream_id: str, after_seq: int, max_records: int) -> Batch:
        log = self._get(stream_id)
        start = after_seq + 1 - log.first_seq
        if start < 0:
            raise ResumeGapError(stream_id, after_seq, log.first_seq)
        return Batch(after_seq + 1, log.events[start : start + max_records])

    def first_seq(self, stream_id: str) -> int:
        """The seq of the oldest retained record (of the next one, when none is)."""
        return self._get(stream_id).first_seq

    def last_seq(self, stream_id: str) -> int:
        log = self._get(stream_id)
        return log.first_seq + len(log.events) - 1

    def watch(self, stream_id: str, after_seq: int, waiter: Waiter) -> None:
        log = self._logs.get(stream_id)
        if log is None or log.first_seq + len(log.events) - 1 > after_seq:
            if not waiter.done():
                waiter.set_result(None)
            return
        log.waiters.append(waiter)

    def unwatch(self, stream_id: str, waiter: Waiter) -> None:
        log = self._logs.get(stream_id)
        if log is not None and waiter in log.waiters:
            log.waiters.remove(waiter)

    async def delete(self, stream_id: str) -> None:
        self.drop(stream_id)

    def drop(self, stream_id: str) -> None:
        """:meth:`delete`, synchronously; nothing for an unknown stream."""
        log = self._logs.pop(stream_id, None)
        if log is None:
            return
        self._total_bytes -= LOG_BYTES + log.num_bytes
        if self._observer is not None:
            self._observer.deleted(stream_id)
        self._wake(log)

    async def aclose(self) -> None:
        for stream_id in list(self._logs):
            self.drop(stream_id)

    @staticmethod
    def _wake(log: _Log) -> None:
        # Swap the list first: a waiter may watch again from inside ``set_result`` (a
        # connection that writes at once and then waits for more).
        waiters, log.waiters = log.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
