"""The writer of a Redis event log: every write of a replica, batched into round trips.

A :class:`RedisWriter` queues commands (:meth:`send`, :meth:`execute`) and appends
(:meth:`append`), and, inside :meth:`running`, sends everything queued since its last
round trip as ONE pipeline: an engine step that appends a token to 1,000 streams costs
one round trip, not 1,000. The appends of a round trip go in one Lua call (``APPEND``)
per cluster slot: on one Redis, one call for all of them (a command each would cost
redis-py more CPU than the token); on a Redis Cluster, one per stream slot, which the
cluster client sends as one pipeline per node, in parallel.

**Shared log bytes.** For the streams the hub asks it to count (:meth:`count_bytes`),
each round trip also adds to the registry's counters (:mod:`sluice.streams.redis_codec`)
what their logs grew (or shrank, by trims) since their last append: one ``INCRBY`` and
one ``HINCRBY`` per tenant per round trip, and one field of the stream's record updated
inside its ``APPEND`` (so a lease sweep knows what a dead replica's stream counted). The
bytes are those of the replica's mirror (:mod:`sluice.streams.sizing`), one append
behind: a stream's last append is never counted, its closing takes out what was.

Once Redis answers, ``on_written`` applies each append (to the mirror, waking the local
readers), so no replica ever shows an event another could not resume from. A write
Redis refused or never answered fails its waiter with :class:`RedisUnavailableError`
(retryable) and its stream is reported to ``on_failed``, with the message when no waiter
was told.

**Appends nobody waits for** (:meth:`append` with ``wait=False``: a producer's tokens).
A producer that waited for each token's round trip would be suspended once more per
token (its next token is awaited anyway), and its stream would have one append in
flight at a time; without waiting, it goes on and the round trip carries what it queued
meanwhile. What readers see does not change: an append reaches the mirror, and wakes
them, only once Redis has it. What changes is who learns of a failure, and when: the
stream is reported to ``on_failed`` with the message (its log raises it at the stream's
next append), and every write of that stream still queued is dropped (failed), so Redis
never gets a later event after a missing one. At most :data:`MAX_PIPELINE_COMMANDS`
writes wait in the queue; an append beyond that waits for its round trip (backpressure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import NoScriptError, RedisError
from redis.typing import EncodableT

from sluice.errors import BackendError
from sluice.events import NeutralEvent
from sluice.streams.redis_client import Command, RedisClient, is_cluster, slot_groups
from sluice.streams.redis_codec import (
    LOG_BYTES_KEY,
    TENANT_LOG_BYTES_KEY,
    log_key,
    meta_key,
)
from sluice.streams.redis_scripts import APPEND
from sluice.streams.sizing import LOG_BYTES

__all__ = [
    "MAX_PIPELINE_COMMANDS",
    "WRITE_TIMEOUT_S",
    "Append",
    "RedisUnavailableError",
    "RedisWriter",
]

logger = logging.getLogger("sluice.streams.redis")

# A write pipeline that has not been answered in this long is failed: Redis is gone, and a
# producer waiting on it must end its stream rather than hang.
WRITE_TIMEOUT_S = 2.0
# Commands one pipeline carries at most (an engine step of 1,000 streams is ~1,000 appends
# of two commands); the rest wait for the next round trip.
MAX_PIPELINE_COMMANDS = 8_192


class RedisUnavailableError(BackendError):
    """Redis did not take a write (down, restarting, or too slow to answer)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


@dataclass(frozen=True, slots=True)
class Append:
    """One append of one stream: its events, and its arguments of ``APPEND``."""

    stream_id: str
    events: Sequence[NeutralEvent]
    first_seq: int
    terminal: bool
    encoded: Sequence[bytes]


@dataclass(slots=True)
class _Write:
    commands: list[Command]
    future: asyncio.Future[None] | None
    append: Append | None = None


@dataclass(slots=True)
class _Counted:
    """A stream whose log bytes count in Redis: its tenant, and the bytes counted."""

    tenant: str
    num_bytes: int = LOG_BYTES


class RedisWriter:
    """Batches a replica's writes to Redis into round trips (see the module doc)."""

    def __init__(
        self,
        client: RedisClient,
        max_records: int,
        on_written: Callable[[Append], None],
        on_failed: Callable[[str, str | None], None],
        log_bytes: Callable[[str], int | None],
    ) -> None:
        self._client = client
        self._cluster = is_cluster(client)
        self._max_records = max_records
        self._on_written = on_written
        self._on_failed = on_failed
        self._log_bytes = log_bytes  # a stream's bytes in this replica's mirror, if held
        self._queue: list[_Write] = []
        self._queued = asyncio.Event()
        self._running = False
        self._append_sha: str | None = None
        self._counted: dict[str, _Counted] = {}
        self.num_round_trips = 0

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RedisWriter]:
        """Send the queued writes, a round trip at a time, for the ``async with`` block;
        then the last queued commands (registry updates) go out."""
        async with asyncio.TaskGroup() as tasks:
            self._running = True
            if not self._queue:
                self._queued.clear()
            tasks.create_task(self._write_loop())
            try:
                yield self
            finally:
                # The loop ends after its round trip in flight (bounded by WRITE_TIMEOUT_S),
                # not cancelled inside it: a cancel there can be lost in the client, and
                # the write with it.
                self._running = False
                self._queued.set()
        await self.drain()
        self.close()

    async def drain(self) -> None:
        """Send what is queued now, if anything (a lost write is logged)."""
        if self._queue:
            with contextlib.suppress(RedisUnavailableError):
                await self.execute(("PING",))

    def close(self) -> None:
        """Fail every write still queued."""
        for write in self._queue:
            if write.future is not None and not write.future.done():
                write.future.set_exception(RedisUnavailableError("the event log closed"))
        self._queue.clear()
        self._counted.clear()

    # ------------------------------------------------------------------ shared bytes

    def count_bytes(self, stream_id: str, tenant: str) -> None:
        """Count ``stream_id``'s log bytes in Redis from now on (its admission counted
        those of an empty log)."""
        self._counted[stream_id] = _Counted(tenant)

    def uncount(self, stream_id: str) -> tuple[str, int] | None:
        """Stop counting ``stream_id``; its tenant and the bytes Redis counted for it."""
        counted = self._counted.pop(stream_id, None)
        return None if counted is None else (counted.tenant, counted.num_bytes)

    # ------------------------------------------------------------------ writes

    def send(self, *commands: Command) -> None:
        """Queue commands for the next round trip, without waiting for it (a lost one is
        logged: what it did is also done by a timeout, a lease or an ``EXPIRE``)."""
        self._submit(_Write(list(commands), None))

    async def execute(self, *commands: Command) -> None:
        """Queue commands for the next round trip and wait for it; raises
        :class:`RedisUnavailableError`."""
        await self._wait(_Write(list(commands), None))

    async def append(self, append: Append, *, wait: bool = True) -> None:
        """Write ``append`` with the next round trip and wait for Redis to have it; with
        ``wait=False`` (and the writer running, its queue not full), only queue it (see
        the module doc)."""
        if not wait and self._running and len(self._queue) < MAX_PIPELINE_COMMANDS:
            self._submit(_Write([], None, append))
            return
        await self._wait(_Write([], None, append))

    async def _wait(self, write: _Write) -> None:
        """Send ``write`` with the next round trip and wait for its answer. Outside
        :meth:`running` (no writer loop), it goes at once, with whatever was queued."""
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
            if not self._running:
                return
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

    # ------------------------------------------------------------------ one round trip

    def _grown(self, append: Append) -> int:
        """What the stream's log grew by since its bytes were last counted (0 when they
        are not counted)."""
        counted = self._counted.get(append.stream_id)
        held = self._log_bytes(append.stream_id)
        if counted is None or held is None:
            return 0
        grown = held - counted.num_bytes
        counted.num_bytes = held
        return grown

    def _script_calls(
        self, appends: list[Append]
    ) -> tuple[list[list[EncodableT]], list[list[Append]], dict[str, int]]:
        """The round trip's ``APPEND`` calls (their keys and args, one per slot group),
        the appends each call carries, and what each tenant's counted bytes grew by."""
        calls: list[list[EncodableT]] = []
        groups = slot_groups(appends, lambda a: log_key(a.stream_id), self._cluster)
        grown_by_tenant: dict[str, int] = {}
        for group in groups:
            keys: list[EncodableT] = []
            args: list[EncodableT] = [self._max_records]
            for append in group:
                keys += (log_key(append.stream_id), meta_key(append.stream_id))
                grown = self._grown(append)
                if grown:
                    tenant = self._counted[append.stream_id].tenant
                    grown_by_tenant[tenant] = grown_by_tenant.get(tenant, 0) + grown
                terminal = 1 if append.terminal else 0
                args.append(
                    b"%d %d %d %d" % (append.first_seq, len(append.encoded), terminal, grown)
                )
                args += append.encoded
            calls.append([len(keys), *keys, *args])
        return calls, groups, grown_by_tenant

    async def _flush(self, batch: list[_Write]) -> None:
        """One round trip: the batch's commands in order, the shared byte counts, then its
        appends (one ``APPEND`` call per slot group)."""
        appends = [write.append for write in batch if write.append is not None]
        calls, groups, grown_by_tenant = self._script_calls(appends)
        counts: list[Command] = []
        if grown_by_tenant:
            counts.append(("INCRBY", LOG_BYTES_KEY, sum(grown_by_tenant.values())))
            counts += [("HINCRBY", TENANT_LOG_BYTES_KEY, t, n) for t, n in grown_by_tenant.items()]
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                results = await self._send_batch(batch, counts, calls)
                scripts = results[len(results) - len(calls) :]
                if any(isinstance(answer, NoScriptError) for answer in scripts):
                    self._append_sha = None  # Redis restarted (or a node did): load it again
                    results = await self._send_batch(batch, [], calls)
        except (RedisError, OSError, TimeoutError) as exc:
            logger.warning("Redis write failed: %s", exc)
            for write in batch:
                self._failed(write, f"Redis did not take the write: {exc}")
            return
        # Each append's answer, by identity (the calls answer them slot group by group).
        answer_of: dict[int, object] = {}
        for group, answer in zip(groups, results[len(results) - len(calls) :], strict=True):
            answers = answer if isinstance(answer, list) else [answer] * len(group)
            answer_of.update(zip(map(id, group), answers, strict=False))
        offset = 0
        for write in batch:
            error: object = None
            if write.commands:  # an append alone (nearly every write) has none
                answers = results[offset : offset + len(write.commands)]
                offset += len(write.commands)
                error = next((a for a in answers if isinstance(a, Exception)), None)
            if write.append is not None:
                answer = answer_of.get(id(write.append))
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
            if write.append is not None:
                self._on_written(write.append)

    async def _send_batch(
        self, batch: list[_Write], counts: list[Command], calls: list[list[EncodableT]]
    ) -> list[object]:
        """One pipeline: the batch's commands, the counts, then the ``EVALSHA`` calls (the
        script is loaded once, not checked per round trip as redis-py's scripts are)."""
        if calls and self._append_sha is None:
            self._append_sha = str(await self._client.script_load(APPEND))
        pipe = self._client.pipeline(transaction=False)
        for write in batch:
            for command in write.commands:
                pipe.execute_command(*command)
        for command in counts:
            pipe.execute_command(*command)
        for call in calls:
            pipe.execute_command("EVALSHA", self._append_sha or "", *call)
        self.num_round_trips += 1
        results: list[object] = await pipe.execute(raise_on_error=False)
        return results

    def _failed(self, write: _Write, message: str) -> None:
        future = write.future
        told = future is not None and not future.done()
        if future is not None and not future.done():
            future.set_exception(RedisUnavailableError(message))
        if write.append is not None:
            stream_id = write.append.stream_id
            self._counted.pop(stream_id, None)  # a lease sweep uncounts it
            self._on_failed(stream_id, None if told else message)
            # Nothing of this stream may follow the missing events into Redis.
            behind = [w for w in self._queue if w.append and w.append.stream_id == stream_id]
            if behind:
                self._queue[:] = [w for w in self._queue if w not in behind]
                for dropped in behind:
                    if dropped.future is not None and not dropped.future.done():
                        dropped.future.set_exception(RedisUnavailableError(message))
        elif not told:
            logger.warning("%s", message)
