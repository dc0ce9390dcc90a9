"""The Redis Streams event log: one Redis stream per Sluice stream, shared by replicas.

Reads stay synchronous (the :class:`~sluice.streams.log.EventLog` contract): every
replica keeps a local mirror (a :class:`~sluice.streams.memory.MemoryEventLog`, with the
frame cache as its observer) of the streams it writes or serves, and reads that.

- **Writes** (the producer's replica): :meth:`append` assigns the seqs and hands the
  append to the :class:`~sluice.streams.redis_writer.RedisWriter`, which batches every
  write of a round trip into one pipeline (an ``XADD`` per event, entry id ``0-<seq>``,
  ``MAXLEN ~`` the record bound, and a ``PUBLISH`` of the whole append) and applies it
  to the mirror once Redis has it. A write Redis refused or never answered raises
  :class:`~sluice.errors.BackendError` (retryable) and leaves the stream local: its
  terminal event reaches this replica's readers only (the producer lease then gives
  Redis's copy its own, see :mod:`sluice.streams.redis_registry`). An append made with
  ``wait=False`` (the producer's tokens) returns once queued; if Redis does not take it,
  the stream's next append (or :meth:`sync`) raises that failure, once.
- **Following** (any other replica): :meth:`follow` mirrors a stream written elsewhere
  (:class:`~sluice.streams.redis_follower.RedisFollower`).
- Retention is Redis's ``EXPIRE`` (set by the hub's registry); :meth:`delete` drops the
  mirror and, for a stream this replica writes, the Redis key.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from sluice.errors import StreamNotFoundError
from sluice.events import NeutralEvent, is_terminal
from sluice.streams.log import Batch, LogLimits, LogObserver, Waiter
from sluice.streams.memory import MemoryEventLog
from sluice.streams.redis_client import Command, RedisClient
from sluice.streams.redis_codec import encode_event, entry_id, log_key
from sluice.streams.redis_follower import RedisFollower
from sluice.streams.redis_writer import (
    MAX_PIPELINE_COMMANDS,
    WRITE_TIMEOUT_S,
    Append,
    RedisUnavailableError,
    RedisWriter,
)

__all__ = [
    "MAX_PIPELINE_COMMANDS",
    "WRITE_TIMEOUT_S",
    "RedisEventLog",
    "RedisUnavailableError",
]


class RedisEventLog:
    """An :class:`~sluice.streams.log.EventLog` in Redis, read through a local mirror."""

    def __init__(
        self,
        client: RedisClient,
        limits: LogLimits | None = None,
        observer: LogObserver | None = None,
    ) -> None:
        self._client = client
        self._limits = limits or LogLimits()
        self.mirror = MemoryEventLog(self._limits, observer)
        self._next_seq: dict[str, int] = {}  # streams written here: the seq to assign next
        self._local_only: set[str] = set()  # written here, but Redis stopped taking them
        # Of those, the ones whose producer has not been told yet (an append nobody waited
        # for failed): the failure its next append raises.
        self._unreported: dict[str, str] = {}
        self.writer = RedisWriter(
            client, self._limits.max_records, self._written, self._failed, self._held
        )
        self._follower = RedisFollower(client, self.mirror)
        self.num_appends = 0

    @property
    def client(self) -> RedisClient:
        return self._client

    @property
    def num_round_trips(self) -> int:
        return self.writer.num_round_trips

    @property
    def on_lost(self) -> Callable[[str], None] | None:
        """Called with each followed stream dropped because Redis went away."""
        return self._follower.on_lost

    @on_lost.setter
    def on_lost(self, handler: Callable[[str], None] | None) -> None:
        self._follower.on_lost = handler

    def set_control(self, channel: str, handler: Callable[[bytes], None]) -> None:
        """Also listen on ``channel`` (the replica's cancel bus), before :meth:`running`."""
        self._follower.set_control(channel, handler)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RedisEventLog]:
        """Run the writer and the subscriber for the ``async with`` block."""
        async with self.writer.running(), self._follower.running():
            yield self
        await self.aclose()

    # ------------------------------------------------------------------ EventLog

    async def create(self, stream_id: str) -> None:
        self.mirror.open(stream_id)
        self._next_seq[stream_id] = 1

    async def append(
        self, stream_id: str, events: Sequence[NeutralEvent], *, wait: bool = True
    ) -> int:
        next_seq = self._next_seq.get(stream_id)
        if next_seq is None or stream_id in self._local_only:
            self._raise_unreported(stream_id)
            if stream_id not in self.mirror:
                raise StreamNotFoundError(stream_id)
            return self.mirror.extend(stream_id, events)
        self._next_seq[stream_id] = next_seq + len(events)
        encoded = [encode_event(event) for event in events]
        terminal = bool(events) and is_terminal(events[-1])
        append = Append(stream_id, events, next_seq, terminal, encoded)
        await self.writer.append(append, wait=wait or terminal)  # an end is always waited for
        return next_seq + len(events) - 1

    async def sync(self, stream_id: str) -> None:
        if stream_id in self._next_seq and stream_id not in self._local_only:
            # The next round trip goes after every write queued before it.
            with contextlib.suppress(RedisUnavailableError):
                await self.writer.execute(("PING",))
        self._raise_unreported(stream_id)

    def _raise_unreported(self, stream_id: str) -> None:
        message = self._unreported.pop(stream_id, None)
        if message is not None:
            raise RedisUnavailableError(message)

    def read(self, stream_id: str, after_seq: int, max_records: int) -> Batch:
        return self.mirror.read(stream_id, after_seq, max_records)

    def last_seq(self, stream_id: str) -> int:
        return self.mirror.last_seq(stream_id)

    def num_bytes(self, stream_id: str) -> int:
        return self.mirror.num_bytes(stream_id)

    def trim(self, stream_id: str, max_bytes: int) -> None:
        self.mirror.trim(stream_id, max_bytes)
        if stream_id in self._next_seq and stream_id not in self._local_only:
            first_seq = self.mirror.first_seq(stream_id)
            self.send(("XTRIM", log_key(stream_id), "MINID", entry_id(first_seq)))

    def watch(self, stream_id: str, after_seq: int, waiter: Waiter) -> None:
        self.mirror.watch(stream_id, after_seq, waiter)

    def unwatch(self, stream_id: str, waiter: Waiter) -> None:
        self.mirror.unwatch(stream_id, waiter)

    async def delete(self, stream_id: str) -> None:
        if self._next_seq.pop(stream_id, None) is not None:
            if stream_id not in self._local_only:
                self.send(("DEL", log_key(stream_id)))
            self._local_only.discard(stream_id)
        self._unreported.pop(stream_id, None)
        self.writer.uncount(stream_id)
        self.unfollow(stream_id)
        self.mirror.drop(stream_id)

    async def aclose(self) -> None:
        await self.writer.drain()  # the last registry updates go out first
        self.writer.close()
        self._next_seq.clear()
        self._local_only.clear()
        self._unreported.clear()
        await self.mirror.aclose()

    @property
    def total_bytes(self) -> int:
        return self.mirror.total_bytes

    def writes_here(self, stream_id: str) -> bool:
        return stream_id in self._next_seq

    def is_local_only(self, stream_id: str) -> bool:
        """Written here, but a write to Redis failed: the rest stays in this process."""
        return stream_id in self._local_only

    # ------------------------------------------------------------------ writer

    def send(self, *commands: Command) -> None:
        """Queue commands for the next round trip (see :meth:`RedisWriter.send`)."""
        self.writer.send(*commands)

    async def execute(self, *commands: Command) -> None:
        """Queue commands for the next round trip and wait for it; raises
        :class:`RedisUnavailableError`."""
        await self.writer.execute(*commands)

    def _failed(self, stream_id: str, message: str | None) -> None:
        """Redis did not take a write of the stream (``message``: nobody was told)."""
        self._local_only.add(stream_id)
        if message is not None and stream_id in self._next_seq:
            self._unreported.setdefault(stream_id, message)

    def _written(self, append: Append) -> None:
        if append.stream_id in self.mirror:
            self.num_appends += 1
            self.mirror.extend(append.stream_id, append.events)

    def _held(self, stream_id: str) -> int | None:
        return self.mirror.num_bytes(stream_id) if stream_id in self.mirror else None

    # ------------------------------------------------------------------ following

    def follows(self, stream_id: str) -> bool:
        return self._follower.follows(stream_id)

    async def follow(self, stream_id: str) -> None:
        """Mirror a stream written elsewhere until :meth:`unfollow`; raises
        :class:`RedisUnavailableError`."""
        if stream_id not in self._next_seq:
            await self._follower.follow(stream_id)

    def unfollow(self, stream_id: str) -> None:
        self._follower.unfollow(stream_id)
