"""The Redis Streams event log: one Redis stream per Sluice stream, shared by replicas.

Reads stay synchronous (the :class:`~sluice.streams.log.EventLog` contract): every
replica keeps a local mirror (a :class:`~sluice.streams.memory.MemoryEventLog`, with the
frame cache as its observer) of the streams it writes or serves, and reads that.

- **Writes** (the producer's replica; inside :meth:`running`, where a writer task batches
  them, else one round trip per append): :meth:`append` assigns the seqs, queues its
  events for an ``XADD`` each (entry id ``0-<seq>``, ``MAXLEN ~`` the record bound) and a
  ``PUBLISH`` of the whole append, and waits for the writer. Every append of a round trip
  goes in ONE Lua call (``APPEND``), so redis-py packs one command per step. The writer sends everything queued since
  its last round trip as one pipeline, so an engine step that appends a token to 1,000
  streams costs one round trip, not 1,000; it applies each append to the mirror (and
  wakes the local readers) once Redis has it, so no replica ever shows an event another
  could not resume from. A write Redis refused or never answered raises
  :class:`~sluice.errors.BackendError` (retryable) and leaves the stream local: its
  terminal event reaches this replica's readers only (the producer lease then gives
  Redis's copy its own, see :mod:`sluice.streams.redis_hub`).
- **Following** (any other replica): :meth:`follow` subscribes to the stream's channel,
  then loads what Redis retains (``XRANGE``) into a new mirror; published appends extend
  it, a gap (a message lost to a reconnect) is filled from ``XRANGE``. One pub/sub
  connection per replica carries every followed stream and the replica's control
  channel. If it breaks, every followed stream is dropped and ``on_lost`` tells the hub,
  which ends their connections so clients resume, here or elsewhere, once Redis is back.
- Retention is Redis's ``EXPIRE`` (set by the hub's registry); :meth:`delete` drops the
  mirror and, for a stream this replica writes, the Redis key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import redis.asyncio as redis
from redis.exceptions import NoScriptError, RedisError

from sluice.errors import BackendError, StreamNotFoundError
from sluice.events import NeutralEvent, is_terminal
from sluice.streams.log import Batch, LogLimits, LogObserver, Waiter
from sluice.streams.memory import MemoryEventLog
from sluice.streams.redis_codec import (
    decode_append,
    decode_event,
    encode_append,
    encode_event,
    entry_id,
    entry_seq,
    events_channel,
    log_key,
)
from sluice.streams.redis_scripts import APPEND

__all__ = ["RedisEventLog", "RedisUnavailableError"]

logger = logging.getLogger("sluice.streams.redis")

# A write pipeline that has not been answered in this long is failed: Redis is gone, and a
# producer waiting on it must end its stream rather than hang.
WRITE_TIMEOUT_S = 2.0
# Commands one pipeline carries at most (an engine step of 1,000 streams is ~1,000 appends
# of two commands); the rest wait for the next round trip.
MAX_PIPELINE_COMMANDS = 8_192
# Entries one XRANGE brings back when a mirror is filled.
_RANGE_COUNT = 1_000
# Between attempts to reopen the pub/sub connection after Redis went away.
RECONNECT_DELAY_S = 0.25


class RedisUnavailableError(BackendError):
    """Redis did not take a write (down, restarting, or too slow to answer)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


@dataclass(slots=True)
class _Write:
    commands: list[tuple[object, ...]]
    future: asyncio.Future[None] | None
    # The append this write carries, applied to the mirror once Redis has it, and its
    # arguments of the round trip's one APPEND call.
    stream_id: str = ""
    events: Sequence[NeutralEvent] = ()
    append_args: Sequence[bytes | int] = ()


@dataclass(slots=True)
class _Following:
    """A stream this replica reads but does not write: its channel's messages before its
    mirror is filled wait here."""

    ready: asyncio.Future[bool]
    early: list[bytes] = field(default_factory=list)


class RedisEventLog:
    """An :class:`~sluice.streams.log.EventLog` in Redis, read through a local mirror."""

    def __init__(
        self,
        client: redis.Redis,
        limits: LogLimits | None = None,
        observer: LogObserver | None = None,
    ) -> None:
        self._client = client
        self._limits = limits or LogLimits()
        self.mirror = MemoryEventLog(self._limits, observer)
        self._next_seq: dict[str, int] = {}  # streams written here: the seq to assign next
        self._local_only: set[str] = set()  # written here, but Redis stopped taking them
        self._following: dict[str, _Following] = {}
        self._queue: list[_Write] = []
        self._queued = asyncio.Event()
        self._pubsub: redis.client.PubSub | None = None
        self._control: tuple[str, Callable[[bytes], None]] | None = None
        self._running = False
        self._append_sha: str | None = None
        self._tasks: asyncio.TaskGroup | None = None
        self.on_lost: Callable[[str], None] | None = None
        """Called with each followed stream dropped because Redis went away."""
        self.num_round_trips = 0
        self.num_appends = 0

    @property
    def client(self) -> redis.Redis:
        return self._client

    def set_control(self, channel: str, handler: Callable[[bytes], None]) -> None:
        """Also listen on ``channel`` (the replica's cancel bus), before :meth:`running`."""
        self._control = (channel, handler)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RedisEventLog]:
        """Run the writer and the subscriber for the ``async with`` block."""
        async with asyncio.TaskGroup() as tasks:
            self._running = True
            self._tasks = tasks
            writer = tasks.create_task(self._write_loop())
            listener = tasks.create_task(self._listen_loop())
            try:
                yield self
            finally:
                self._running = False
                self._tasks = None
                writer.cancel()
                listener.cancel()
        await self.aclose()

    # ------------------------------------------------------------------ EventLog

    async def create(self, stream_id: str) -> None:
        self.mirror.open(stream_id)
        self._next_seq[stream_id] = 1

    async def append(self, stream_id: str, events: Sequence[NeutralEvent]) -> int:
        next_seq = self._next_seq.get(stream_id)
        if next_seq is None or stream_id in self._local_only:
            if stream_id not in self.mirror:
                raise StreamNotFoundError(stream_id)
            return self.mirror.extend(stream_id, events)
        self._next_seq[stream_id] = next_seq + len(events)
        encoded = [encode_event(event) for event in events]
        terminal = b"1" if events and is_terminal(events[-1]) else b"0"
        # The append's part of the step's one APPEND call (see APPEND):
        # first seq, count, terminal flag, the events, the published message.
        args: list[bytes | int] = [next_seq, len(encoded), terminal, *encoded]
        args.append(encode_append(next_seq, encoded))
        await self._wait(_Write([], None, stream_id, events, args))
        return next_seq + len(events) - 1

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
        self.unfollow(stream_id)
        self.mirror.drop(stream_id)

    async def aclose(self) -> None:
        if self._running and self._queue:  # the last registry updates go out first
            with contextlib.suppress(RedisUnavailableError):
                await self.execute(("PING",))
        for write in self._queue:
            if write.future is not None and not write.future.done():
                write.future.set_exception(RedisUnavailableError("the event log closed"))
        self._queue.clear()
        self._following.clear()
        self._next_seq.clear()
        self._local_only.clear()
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

    def send(self, *commands: tuple[object, ...]) -> None:
        """Queue commands for the next round trip, without waiting for it (a lost one is
        logged: what it did is also done by a timeout, a lease or an ``EXPIRE``)."""
        self._submit(_Write(list(commands), None))

    async def execute(self, *commands: tuple[object, ...]) -> None:
        """Queue commands for the next round trip and wait for it; raises
        :class:`RedisUnavailableError`."""
        await self._wait(_Write(list(commands), None))

    async def _wait(self, write: _Write) -> None:
        """Send ``write`` with the next round trip and wait for its answer. Outside
        :meth:`running` (no writer), it goes at once, with whatever was queued."""
        future = write.future = asyncio.get_running_loop().create_future()
        if self._running:
            self._submit(write)
        else:
            batch, self._queue = [*self._queue, write], []
            await self._flush(batch)
        # A producer cancelled while its append is in flight still has it applied (the
        # writer applies it; seqs are numbered at submission), so no shield is needed.
        await future

    def _submit(self, write: _Write) -> None:
        self._queue.append(write)
        if self._running:
            self._queued.set()

    async def _write_loop(self) -> None:
        while True:
            await self._queued.wait()
            queue = self._queue
            take = num_commands = 0
            while take < len(queue) and (
                not take or num_commands + len(queue[take].commands) <= MAX_PIPELINE_COMMANDS
            ):
                num_commands += len(queue[take].commands)
                take += 1
            batch = queue[:take]
            del queue[:take]
            if not queue:
                self._queued.clear()
            await self._flush(batch)

    async def _flush(self, batch: list[_Write]) -> None:
        """One round trip: the batch's commands in order, then all its appends in one
        ``APPEND`` call (a command each would cost redis-py more CPU than the token)."""
        appends = [write for write in batch if write.stream_id]
        keys = [log_key(write.stream_id) for write in appends]
        args: list[bytes | int] = [self._limits.max_records]
        for write in appends:
            args.extend(write.append_args)
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                results = await self._send_batch(batch, keys, args)
                if appends and isinstance(results[-1], NoScriptError):  # Redis restarted
                    self._append_sha = None
                    results = await self._send_batch(batch, keys, args)
        except (RedisError, OSError, TimeoutError) as exc:
            logger.warning("Redis write failed: %s", exc)
            for write in batch:
                self._failed(write, f"Redis did not take the write: {exc}")
            return
        last = results[-1] if appends else None
        appended: list[object] = list(last) if isinstance(last, list) else [last] * len(appends)
        offset = 0
        taken = iter(appended)
        for write in batch:
            answers = results[offset : offset + len(write.commands)]
            offset += len(write.commands)
            error: object = next((a for a in answers if isinstance(a, Exception)), None)
            if write.stream_id:
                answer = next(taken)
                if isinstance(answer, Exception):
                    error = answer
                elif answer != 1:
                    error = "the log already ends (its producer's lease was lost)"
            if error is not None:
                self._failed(write, f"Redis refused the write: {error}")
                continue
            # The writer first, then the readers: a producer that just wrote its terminal
            # event marks the stream ended before any reader sees that event (as with the
            # memory log, whose appends wake readers only when the producer yields).
            if write.future is not None and not write.future.done():
                write.future.set_result(None)
            if write.stream_id and write.stream_id in self.mirror:
                self.num_appends += 1
                self.mirror.extend(write.stream_id, write.events)

    async def _send_batch(
        self, batch: list[_Write], keys: list[str], args: list[bytes | int]
    ) -> list[object]:
        """One pipeline: the batch's commands, then its appends as one ``EVALSHA`` (the
        script is loaded once, not checked per round trip as redis-py's scripts are)."""
        if keys and self._append_sha is None:
            self._append_sha = await self._client.script_load(APPEND)
        pipe = self._client.pipeline(transaction=False)
        for write in batch:
            for command in write.commands:
                pipe.execute_command(*command)
        if keys:
            pipe.execute_command("EVALSHA", self._append_sha, len(keys), *keys, *args)
        self.num_round_trips += 1
        results: list[object] = await pipe.execute(raise_on_error=False)
        return results

    def _failed(self, write: _Write, message: str) -> None:
        if write.stream_id:
            self._local_only.add(write.stream_id)
        if write.future is not None and not write.future.done():
            write.future.set_exception(RedisUnavailableError(message))
        elif write.future is None:
            logger.warning("%s", message)

    # ------------------------------------------------------------------ following

    def follows(self, stream_id: str) -> bool:
        return stream_id in self._following

    async def follow(self, stream_id: str) -> None:
        """Mirror a stream written elsewhere until :meth:`unfollow`; raises
        :class:`RedisUnavailableError`."""
        if stream_id in self._next_seq:
            return
        following = self._following.get(stream_id)
        if following is not None:
            await asyncio.shield(following.ready)
            return
        pubsub = self._pubsub
        if pubsub is None:
            raise RedisUnavailableError("not connected to Redis")
        following = _Following(asyncio.get_running_loop().create_future())
        self._following[stream_id] = following
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await pubsub.subscribe(events_channel(stream_id))
                entries = await self._range(stream_id, None)
        except (RedisError, OSError, TimeoutError) as exc:
            self._following.pop(stream_id, None)
            following.ready.set_result(False)
            raise RedisUnavailableError(f"Redis did not answer: {exc}") from exc
        if self._following.get(stream_id) is not following:  # lost meanwhile
            raise RedisUnavailableError("Redis went away while the stream loaded")
        self.mirror.open(stream_id, entries[0][0] if entries else 1)
        self._apply_entries(stream_id, entries)
        for data in following.early:
            await self._apply_message(stream_id, data)
        following.early.clear()
        following.ready.set_result(True)

    def unfollow(self, stream_id: str) -> None:
        following = self._following.pop(stream_id, None)
        if following is None:
            return
        self.mirror.drop(stream_id)
        pubsub = self._pubsub
        if pubsub is not None and self._running:
            channel = events_channel(stream_id)
            if self._tasks is not None:
                self._tasks.create_task(_quietly(pubsub.unsubscribe(channel)))

    async def _range(self, stream_id: str, after_seq: int | None) -> list[tuple[int, NeutralEvent]]:
        start = "-" if after_seq is None else f"({entry_id(after_seq)}"
        entries: list[tuple[int, NeutralEvent]] = []
        while True:
            raw = await self._client.xrange(log_key(stream_id), start, "+", count=_RANGE_COUNT)
            raw = raw or []
            for eid, fields in raw:
                if not isinstance(eid, bytes):
                    raise ValueError("an entry without an id")
                entries.append((entry_seq(eid), decode_event(_field(fields, b"e"))))
            if len(raw) < _RANGE_COUNT:
                return entries
            start = f"({entry_id(entries[-1][0])}"

    def _apply_entries(self, stream_id: str, entries: list[tuple[int, NeutralEvent]]) -> None:
        last = self.mirror.last_seq(stream_id)
        fresh = [event for seq, event in entries if seq > last]
        if fresh:
            self.mirror.extend(stream_id, fresh)

    async def _apply_message(self, stream_id: str, data: bytes) -> None:
        first_seq, events = decode_append(data)
        last = self.mirror.last_seq(stream_id)
        if first_seq > last + 1:  # missed some: fill from the log
            self._apply_entries(stream_id, await self._range(stream_id, last))
            return
        skip = last + 1 - first_seq
        if skip < len(events):
            self.mirror.extend(stream_id, events[skip:])

    async def _listen_loop(self) -> None:
        while True:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                if self._control is not None:
                    await pubsub.subscribe(self._control[0])
                else:
                    await pubsub.subscribe("sluice:log:keepalive")
                self._pubsub = pubsub
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is not None:
                        await self._dispatch(message["channel"], message["data"])
            except (RedisError, OSError) as exc:
                logger.warning("Redis subscription lost: %s", exc)
            finally:
                self._pubsub = None
                self._lose_all()
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _dispatch(self, channel: bytes, data: bytes) -> None:
        name = channel.decode()
        if self._control is not None and name == self._control[0]:
            self._control[1](data)
            return
        stream_id = name.split("{", 1)[-1].split("}", 1)[0]
        following = self._following.get(stream_id)
        if following is None:
            return
        if not following.ready.done():
            following.early.append(data)
            return
        if stream_id in self.mirror:
            try:
                await self._apply_message(stream_id, data)
            except (RedisError, OSError):
                raise
            except Exception:  # a message this version cannot read: drop the stream
                logger.exception("stream %s: unreadable message; unfollowing", stream_id)
                self._lose(stream_id)

    def _lose_all(self) -> None:
        for stream_id in list(self._following):
            self._lose(stream_id)

    def _lose(self, stream_id: str) -> None:
        following = self._following.pop(stream_id, None)
        if following is not None and not following.ready.done():
            following.ready.set_result(False)
        if self.on_lost is not None:
            self.on_lost(stream_id)
        self.mirror.drop(stream_id)


def _field(fields: object, name: bytes) -> bytes:
    """Field ``name`` of an entry as redis-py returns it (a dict of bytes)."""
    if isinstance(fields, dict):
        value = fields.get(name)
        if isinstance(value, bytes):
            return value
    raise ValueError(f"an entry without its {name.decode()!r} field")


async def _quietly(awaitable: Awaitable[object]) -> None:
    """An unsubscribe: if it fails, the subscription's connection is gone with it."""
    try:
        await awaitable
    except (RedisError, OSError, AttributeError) as exc:  # redis-py: a connection closed
        logger.debug("unsubscribe failed: %s", exc)
