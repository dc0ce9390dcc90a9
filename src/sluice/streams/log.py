"""The event log seam: what the hub needs from a store of stream events.

Implementations: :class:`sluice.streams.memory.MemoryEventLog` (one process) and, later, a
Redis Streams log (several replicas). The contract tests in ``tests/streams`` run against
every implementation.

Contract:

- ``create`` opens an empty log; events are numbered 1, 2, 3 ... by ``append``.
- ``read(after_seq)`` returns a :class:`Batch` of the retained records with
  ``seq > after_seq``, oldest first, at most ``max_records`` (an empty batch when there
  are none yet). Asking for a position older than the oldest retained record
  raises :class:`~sluice.errors.ResumeGapError`; an unknown stream raises
  :class:`~sluice.errors.StreamNotFoundError`.
- ``read`` and ``last_seq`` are synchronous: a reader reads what this process holds, so a
  connection can be driven by callbacks without a task. (A shared-store log keeps a local
  mirror of the streams being read, fed by one subscription per stream.)
- ``watch(after_seq, waiter)`` resolves ``waiter`` (a :class:`Waiter` owned by the caller) as soon as
  a record with ``seq > after_seq`` exists, at once if one already does, or when the log is
  deleted. ``unwatch`` forgets it. Waiters are futures, not tasks: a held idle reader costs
  one future.
- A log holds neutral events only, never wire bytes. A layer above may keep something
  beside each record (the delivery layer's encoded frames, see
  :class:`LogObserver`): the log tells it of every append, trim and delete, and counts
  what it holds for a record in the log's bytes, so one budget bounds both.
- A log is bounded in records and bytes: the oldest records are dropped first, never the
  newest. Bytes are what the records hold in memory (:mod:`sluice.streams.sizing`: the
  events, and what its observer keeps beside them), not their length on the wire.
- ``num_bytes`` is what one stream's log holds now, its own overhead included;
  ``trim(max_bytes)`` drops the stream's oldest records until it holds at most
  ``max_bytes`` (or only its newest record). The hub's server-wide budget and tenant caps
  are enforced with these two (see :mod:`sluice.streams.budget`).
- Retention is the hub's business: it deletes a finished stream's log when the stream's
  retention window ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sluice.events import NeutralEvent

__all__ = ["Batch", "EventLog", "LogLimits", "LogObserver", "Waiter"]


class Waiter(Protocol):
    """What a log wakes when records arrive: an asyncio future, or any object with the same
    two methods (a connection driven by callbacks is its own waiter, so an idle reader
    holds no future)."""

    def done(self) -> bool: ...

    def set_result(self, result: None, /) -> None: ...


@dataclass(frozen=True, slots=True)
class Batch:
    """Consecutive records of one stream: event ``first_seq + i`` is ``events[i]``.

    A batch is read in one go, so its cost is paid per read, not per event.
    """

    first_seq: int
    events: Sequence[NeutralEvent]

    def __len__(self) -> int:
        return len(self.events)

    @property
    def last_seq(self) -> int:
        """The seq of the last event (``first_seq - 1`` for an empty batch)."""
        return self.first_seq + len(self.events) - 1


@dataclass(frozen=True, slots=True)
class LogLimits:
    """Per-stream bounds of a log."""

    # A long generation is a few thousand tokens; 100k events leave room for coalescing-free
    # tool-call fragments without letting one stream take unbounded memory.
    max_records: int = 100_000
    # A one-word token's record (event, and the native frame the delivery layer keeps
    # beside it) holds about 240 bytes, one of 40 characters about 300 (see
    # sluice.streams.sizing): 32 MiB holds a whole 100k-event stream of such tokens.
    max_bytes: int = 32 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_records < 1 or self.max_bytes < 1:
            raise ValueError("log limits must be positive")


class LogObserver(Protocol):
    """What keeps something beside a log's records (the delivery layer's frame cache:
    each record's encoded frames), told of every change to the log.

    The log counts what it holds for a record in that stream's bytes (``num_bytes``, and
    so in the hub's budget) and drops it with the record: trimmed records first leave the
    count, then :meth:`trimmed` tells the observer. Calls are synchronous, quick and must
    not raise.
    """

    def appended(self, stream_id: str, first_seq: int, events: Sequence[NeutralEvent]) -> int:
        """``events`` were appended as ``first_seq``, ``first_seq + 1`` ...; return the
        bytes now held beside them (0 for a stream it keeps nothing for)."""
        ...

    def record_bytes(self, stream_id: str, seq: int) -> int:
        """What it holds beside record ``seq`` (what dropping the record frees)."""
        ...

    def trimmed(self, stream_id: str, first_seq: int) -> None:
        """The records before ``first_seq`` were dropped."""
        ...

    def deleted(self, stream_id: str) -> None:
        """The stream's log was deleted."""
        ...


class EventLog(Protocol):
    """A store of per-stream event records; see the module docstring for the contract."""

    async def create(self, stream_id: str) -> None: ...

    async def append(
        self, stream_id: str, events: Sequence[NeutralEvent], *, wait: bool = True
    ) -> int:
        """Append ``events``; return the seq of the last one. With ``wait`` (the default)
        it returns once they are in the log, readable. Without, a log that stores them
        elsewhere (Redis) may return as soon as they are queued: they become readable (and
        wake readers) once stored, and a failure to store them is raised by the stream's
        next append, or by :meth:`sync`."""
        ...

    async def sync(self, stream_id: str) -> None:
        """Wait until every append of ``stream_id`` so far is in the log; raise the
        failure of one that did not make it, if no append raised it yet."""
        ...

    def read(self, stream_id: str, after_seq: int, max_records: int) -> Batch: ...

    def last_seq(self, stream_id: str) -> int: ...

    def num_bytes(self, stream_id: str) -> int:
        """The memory the stream's log holds now (an estimate; see the module docstring)."""
        ...

    def trim(self, stream_id: str, max_bytes: int) -> None:
        """Drop the stream's oldest records until its log holds at most ``max_bytes``,
        keeping at least its newest record."""
        ...

    def watch(self, stream_id: str, after_seq: int, waiter: Waiter) -> None: ...

    def unwatch(self, stream_id: str, waiter: Waiter) -> None: ...

    async def delete(self, stream_id: str) -> None: ...

    async def aclose(self) -> None: ...
