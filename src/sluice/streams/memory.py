"""In-process event log: the default store, one Python list per stream.

Frames are encoded once, at append, in the native dialect; readers join them as they are.
Waiters are futures kept in a per-stream list and resolved by the next append.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from sluice.dialects import native
from sluice.errors import ResumeGapError, StreamNotFoundError
from sluice.events import NeutralEvent
from sluice.streams.ids import event_id
from sluice.streams.log import LogLimits, Record

__all__ = ["MemoryEventLog"]


class _Log:
    __slots__ = ("first_seq", "num_bytes", "records", "waiters")

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.first_seq = 1  # seq of records[0] (or of the next record, when empty)
        self.num_bytes = 0
        self.waiters: list[asyncio.Future[None]] = []


class MemoryEventLog:
    """An :class:`~sluice.streams.log.EventLog` in this process's memory."""

    def __init__(self, limits: LogLimits | None = None) -> None:
        self._limits = limits or LogLimits()
        self._logs: dict[str, _Log] = {}

    def __len__(self) -> int:
        return len(self._logs)

    def _get(self, stream_id: str) -> _Log:
        log = self._logs.get(stream_id)
        if log is None:
            raise StreamNotFoundError(stream_id)
        return log

    async def create(self, stream_id: str) -> None:
        if stream_id in self._logs:
            raise ValueError(f"log for {stream_id!r} already exists")
        self._logs[stream_id] = _Log()

    async def append(self, stream_id: str, events: Sequence[NeutralEvent]) -> int:
        log = self._get(stream_id)
        records = log.records
        seq = log.first_seq + len(records)
        for event in events:
            data = native.frame(event, event_id(stream_id, seq))
            records.append(Record(seq, event, data))
            log.num_bytes += len(data)
            seq += 1
        if len(records) > self._limits.max_records or log.num_bytes > self._limits.max_bytes:
            self._trim(log)
        if log.waiters:
            _wake(log.waiters)
        return seq - 1

    def _trim(self, log: _Log) -> None:
        # Drop at least a tenth of the bound at once so trimming is amortised O(1) per append.
        limits = self._limits
        records = log.records
        keep_records = limits.max_records - limits.max_records // 10
        keep_bytes = limits.max_bytes - limits.max_bytes // 10
        drop = max(0, len(records) - keep_records)
        num_bytes = log.num_bytes - sum(len(r.frame) for r in records[:drop])
        while drop < len(records) - 1 and num_bytes > keep_bytes:
            num_bytes -= len(records[drop].frame)
            drop += 1
        del records[:drop]
        log.first_seq += drop
        log.num_bytes = num_bytes

    async def read(self, stream_id: str, after_seq: int, max_records: int) -> list[Record]:
        log = self._get(stream_id)
        start = after_seq + 1 - log.first_seq
        if start < 0:
            raise ResumeGapError(stream_id, after_seq, log.first_seq)
        return log.records[start : start + max_records]

    async def last_seq(self, stream_id: str) -> int:
        log = self._get(stream_id)
        return log.first_seq + len(log.records) - 1

    def watch(self, stream_id: str, after_seq: int, waiter: asyncio.Future[None]) -> None:
        log = self._logs.get(stream_id)
        if log is None or log.first_seq + len(log.records) - 1 > after_seq:
            if not waiter.done():
                waiter.set_result(None)
            return
        log.waiters.append(waiter)

    def unwatch(self, stream_id: str, waiter: asyncio.Future[None]) -> None:
        log = self._logs.get(stream_id)
        if log is not None and waiter in log.waiters:
            log.waiters.remove(waiter)

    async def delete(self, stream_id: str) -> None:
        self._drop(stream_id)

    def _drop(self, stream_id: str) -> None:
        log = self._logs.pop(stream_id, None)
        if log is None:
            return
        _wake(log.waiters)

    async def aclose(self) -> None:
        for stream_id in list(self._logs):
            self._drop(stream_id)


def _wake(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
    waiters.clear()
