"""The reading side of a Redis event log: streams other replicas write, mirrored here.

:meth:`RedisFollower.follow` subscribes to a stream's channel, then loads what Redis
retains (``XRANGE``) into a new mirror; published appends extend it, a gap (a message lost
to a reconnect) is filled from ``XRANGE``. One pub/sub connection per replica carries
every followed stream and the replica's control channel (its cancel bus). If it breaks,
every followed stream is dropped and ``on_lost`` tells the hub, which ends their
connections so clients resume, here or elsewhere, once Redis is back.

On a Redis Cluster the channels are classic ones: a ``PUBLISH`` on any node reaches a
subscriber on any node (the cluster bus carries it to all of them), so the one
connection still serves every stream, whatever its slot (see the README for what a
sharded channel would change).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from sluice.events import NeutralEvent
from sluice.streams.memory import MemoryEventLog
from sluice.streams.redis_client import RedisClient, ready
from sluice.streams.redis_codec import (
    decode_append,
    decode_event,
    entry_id,
    entry_seq,
    events_channel,
    log_key,
)
from sluice.streams.redis_writer import WRITE_TIMEOUT_S, RedisUnavailableError

__all__ = ["RECONNECT_DELAY_S", "RedisFollower"]

logger = logging.getLogger("sluice.streams.redis")

# Entries one XRANGE brings back when a mirror is filled.
_RANGE_COUNT = 1_000
# Between attempts to reopen the pub/sub connection after Redis went away.
RECONNECT_DELAY_S = 0.25
# How long a stopping follower waits for its listener to end before cancelling it again.
_RECANCEL_S = 0.1
# The channel a replica without a control channel listens on (a pub/sub connection
# needs one subscription to stay open).
_KEEPALIVE_CHANNEL = "sluice:log:keepalive"


@dataclass(slots=True)
class _Following:
    """A stream this replica reads but does not write: its channel's messages before its
    mirror is filled wait here."""

    ready: asyncio.Future[bool]
    early: list[bytes] = field(default_factory=list)


class RedisFollower:
    """Mirrors streams written elsewhere into ``mirror`` (see the module doc)."""

    def __init__(self, client: RedisClient, mirror: MemoryEventLog) -> None:
        self._client = client
        self._mirror = mirror
        self._following: dict[str, _Following] = {}
        self._pubsub: PubSub | None = None
        self._control: tuple[str, Callable[[bytes], None]] | None = None
        self._tasks: asyncio.TaskGroup | None = None
        self.on_lost: Callable[[str], None] | None = None
        """Called with each followed stream dropped because Redis went away."""

    def set_control(self, channel: str, handler: Callable[[bytes], None]) -> None:
        """Also listen on ``channel`` (the replica's cancel bus), before :meth:`running`."""
        self._control = (channel, handler)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RedisFollower]:
        """Listen for the ``async with`` block."""
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            listener = tasks.create_task(self._listen_loop())
            try:
                yield self
            finally:
                self._tasks = None
                listener.cancel()
                # redis-py can lose a cancel that lands while it connects or subscribes
                # (the listener then waits for a message forever): cancel again, a
                # bounded wait apart, until the listener has ended.
                while not listener.done():
                    await asyncio.wait({listener}, timeout=_RECANCEL_S)
                    listener.cancel()
        self._following.clear()

    def follows(self, stream_id: str) -> bool:
        return stream_id in self._following

    async def follow(self, stream_id: str) -> None:
        """Mirror a stream written elsewhere until :meth:`unfollow`; raises
        :class:`RedisUnavailableError`."""
        following = self._following.get(stream_id)
        if following is not None:  # followed, or being loaded by another request
            if not await asyncio.shield(following.ready):
                raise RedisUnavailableError("Redis went away while the stream loaded")
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
        self._mirror.open(stream_id, entries[0][0] if entries else 1)
        self._apply_entries(stream_id, entries)
        for data in following.early:
            await self._apply_message(stream_id, data)
        following.early.clear()
        following.ready.set_result(True)

    def unfollow(self, stream_id: str) -> None:
        following = self._following.pop(stream_id, None)
        if following is None:
            return
        self._mirror.drop(stream_id)
        pubsub = self._pubsub
        if pubsub is not None and self._tasks is not None:
            channel = events_channel(stream_id)
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
        last = self._mirror.last_seq(stream_id)
        fresh = [event for seq, event in entries if seq > last]
        if fresh:
            self._mirror.extend(stream_id, fresh)

    async def _apply_message(self, stream_id: str, data: bytes) -> None:
        first_seq, events = decode_append(data)
        last = self._mirror.last_seq(stream_id)
        if first_seq > last + 1:  # missed some: fill from the log
            self._apply_entries(stream_id, await self._range(stream_id, last))
            return
        skip = last + 1 - first_seq
        if skip < len(events):
            self._mirror.extend(stream_id, events[skip:])

    async def _listen_loop(self) -> None:
        while True:
            try:
                await ready(self._client)
            except (RedisError, OSError) as exc:
                logger.warning("Redis unreachable: %s", exc)
                await asyncio.sleep(RECONNECT_DELAY_S)
                continue
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                channel = self._control[0] if self._control is not None else _KEEPALIVE_CHANNEL
                await pubsub.subscribe(channel)
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
        if stream_id in self._mirror:
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
        self._mirror.drop(stream_id)


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
