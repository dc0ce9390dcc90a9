"""Durable streams: the write side of the Durable Streams protocol, on the hub's logs.

A durable stream is created by a client (``PUT``), appended to (``POST``), closed, forked
and deleted; its records are :class:`~sluice.events.Payload` events in one of the hub's
stored logs (:meth:`StreamHub.open_stored`), so it lives in the same event log and memory
budget as every LLM stream, and a tenant's streams are its own: each tenant has its own
namespace of paths, and nobody else can name them.

State per stream (:class:`DurableStream`): content type, TTL or expiry, closed (and the
producer request that closed it), the last ``Stream-Seq``, idempotent producers' epochs and
sequences, the fork it was created as and how many forks name it. Rules, in the order the
protocol checks them (``PROTOCOL.md`` sections 5.1-5.4 and 4.2):

- a ``PUT`` of an existing path answers ``200`` when its configuration matches, ``409`` when
  not (content type by media type, TTL, expiry, closure, fork source and offsets);
- an append to a closed stream is ``409`` (with ``Stream-Closed``) unless it is a close-only
  request or the very producer request that closed it (then ``204``);
- producers: a stale epoch is ``403``, a new epoch must start at sequence 0 (``400``), a
  sequence already accepted is a duplicate (``204``, nothing appended), one past the next is
  a gap (``409``); producer checks come before ``Stream-Seq``'s (section 5.2);
- forks copy the source's records up to the fork point when created (copy-on-fork, which
  section 4.2 allows), with a sub-offset cutting the next record; the source counts its
  forks, and a source deleted while forks name it is soft-deleted (``410``, its path stays
  taken) until its last fork goes.

Expiry: a sliding ``Stream-TTL`` (reset by reads and writes, not by ``HEAD``) or an absolute
``Stream-Expires-At``; one loop timer per stream, re-armed when it fires early.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.errors import DurableStreamError, InvalidParameterError, StreamNotFoundError
from sluice.events import NeutralEvent, Payload
from sluice.streams.hub import StreamHub
from sluice.streams.reader import Reader

__all__ = [
    "MAX_PRODUCERS_PER_STREAM",
    "Append",
    "Appended",
    "Config",
    "DurableStream",
    "DurableStreams",
    "Fork",
    "ProducerRequest",
    "compact_json",
]

_CLOSED = (("Stream-Closed", "true"),)
# Idempotent producers remembered per stream: past it the one heard from least recently is
# forgotten, and is treated as new if it comes back (section 5.2.1 lets state expire).
MAX_PRODUCERS_PER_STREAM = 1024


def compact_json(value: object) -> bytes:
    """``value`` as compact JSON; a lone surrogate (which JSON text may carry) stays escaped."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode("ascii")


@dataclass(frozen=True, slots=True)
class Fork:
    """A ``PUT`` that forks ``source`` (a path of the same tenant) after event ``offset``
    (``None``: its tail) and ``sub_offset`` bytes or JSON messages of the next record."""

    source: str
    offset: int | None
    sub_offset: int = 0


@dataclass(frozen=True, slots=True)
class Config:
    """What a ``PUT`` asks for; ``content_type`` ``None``: the default (or a fork's source's)."""

    content_type: str | None
    ttl_s: int | None = None
    expires_at: float | None = None
    closed: bool = False
    fork: Fork | None = None


@dataclass(frozen=True, slots=True)
class ProducerRequest:
    """An idempotent producer's headers (section 5.2.1)."""

    id: str
    epoch: int
    seq: int


@dataclass(frozen=True, slots=True)
class Append:
    """A ``POST``: ``records`` (none: close-only), whether it closes, its producer and
    ``Stream-Seq``."""

    records: Sequence[Payload]
    close: bool = False
    producer: ProducerRequest | None = None
    stream_seq: str | None = None


@dataclass(frozen=True, slots=True)
class Appended:
    """What an accepted (or deduplicated) append answers."""

    status: int
    next_seq: int
    closed: bool
    producer: tuple[int, int] | None = None  # (epoch, highest accepted seq)


@dataclass(slots=True, eq=False)
class DurableStream:
    """One durable stream of one tenant."""

    path: str
    tenant: str
    log_id: str
    content_type: str
    ttl_s: int | None = None
    expires_at: float | None = None
    closed: bool = False
    closed_by: tuple[str, int, int] | None = None
    stream_seq: str | None = None
    producers: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (epoch, seq)
    fork: tuple[str, int, int] | None = None  # (source path, offset, sub-offset)
    source: DurableStream | None = None
    num_forks: int = 0
    deleted: bool = False  # soft-deleted: forks still name it
    gone: bool = False  # deleted for good (its log is gone)
    readers: set[Reader] = field(default_factory=set, repr=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    deadline: float | None = None  # time.monotonic() of expiry
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def wake_readers(self) -> None:
        """Readers waiting at the tail look again (the stream closed or went away)."""
        for reader in list(self.readers):
            reader.wake()


class DurableStreams:
    """Every tenant's durable streams, on one hub."""

    def __init__(self, hub: StreamHub) -> None:
        self._hub = hub
        self._streams: dict[tuple[str, str], DurableStream] = {}
        self._by_log: dict[str, DurableStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def hub(self) -> StreamHub:
        return self._hub

    # -- lookup -----------------------------------------------------------------------------

    def get(self, tenant: str, path: str, *, touch: bool = True) -> DurableStream:
        """The tenant's stream at ``path``: raises :class:`StreamNotFoundError`, or ``410``
        for a soft-deleted one. ``touch``: a read or write, which slides its TTL."""
        stream = self._streams.get((tenant, path))
        if stream is None or (stream.deadline is not None and time.monotonic() >= stream.deadline):
            raise StreamNotFoundError(path)
        if stream.deleted:
            raise DurableStreamError(f"stream {path!r} was deleted", stream_id=path, status=410)
        if touch:
            self._touch(stream)
        return stream

    # -- create -----------------------------------------------------------------------------

    async def create(
        self, tenant: str, path: str, config: Config, records: Sequence[Payload], json_mode: bool
    ) -> tuple[DurableStream, bool]:
        """Create the stream, or find the same one (``False``); raises ``409`` for a path
        taken by another configuration, ``404``/``400`` for a bad fork."""
        existing = self._streams.get((tenant, path))
        deadline = None if existing is None else existing.deadline
        if existing is not None and deadline is not None and time.monotonic() >= deadline:
            self.delete(existing)  # expired, its timer not yet run
            existing = None if existing.gone else existing
        source: DurableStream | None = None
        fork: tuple[str, int, int] | None = None
        prefix: list[NeutralEvent] = []
        content_type = config.content_type
        ttl_s, expires_at = config.ttl_s, config.expires_at
        if config.fork is not None:
            source = self._fork_source(tenant, config.fork.source)
            if content_type is None:
                content_type = source.content_type
            elif _media(content_type) != _media(source.content_type):
                raise _conflict(path, "a fork's content type must be its source's")
            if ttl_s is None and expires_at is None:
                ttl_s, expires_at = source.ttl_s, source.expires_at
            fork, prefix = self._fork_prefix(source, config.fork, json_mode)
        content_type = content_type or "application/octet-stream"
        if existing is not None:
            if existing.deleted:
                raise _conflict(path, "the path belongs to a deleted stream that forks still use")
            same = (
                _media(existing.content_type) == _media(content_type)
                and existing.ttl_s == ttl_s
                and _same_time(existing.expires_at, expires_at)
                and existing.closed == config.closed
                and existing.fork == fork
            )
            if not same:
                raise _conflict(path, "a stream with another configuration exists at this path")
            return existing, False
        log_id = await self._hub.open_stored(tenant, self._evicted)
        stream = DurableStream(
            path, tenant, log_id, content_type, ttl_s, expires_at, fork=fork, source=source
        )
        self._streams[(tenant, path)] = stream
        self._by_log[log_id] = stream
        if source is not None:
            source.num_forks += 1
        events = [*prefix, *records]
        if events:
            await self._hub.append_stored(log_id, events)
        stream.closed = config.closed
        self._touch(stream)
        return stream, True

    def _fork_source(self, tenant: str, path: str) -> DurableStream:
        stream = self._streams.get((tenant, path))
        if stream is None or stream.gone:
            raise StreamNotFoundError(path)
        if stream.deleted:
            raise _conflict(path, "the fork's source was deleted")
        return stream

    def _fork_prefix(
        self, source: DurableStream, fork: Fork, json_mode: bool
    ) -> tuple[tuple[str, int, int], list[NeutralEvent]]:
        """The fork's configuration and the records it starts with (copied)."""
        log = self._hub.log
        tail = log.last_seq(source.log_id)
        offset = tail if fork.offset is None else fork.offset
        if fork.offset is None and fork.sub_offset:
            raise InvalidParameterError(
                "Stream-Fork-Sub-Offset needs Stream-Fork-Offset", "Stream-Fork-Sub-Offset"
            )
        if offset > tail:
            raise InvalidParameterError(
                f"Stream-Fork-Offset: past the source's tail (event {tail})", "Stream-Fork-Offset"
            )
        events: list[NeutralEvent] = []
        seq = 0
        while seq < offset:
            batch = log.read(source.log_id, seq, offset - seq)
            events.extend(batch.events)
            seq = batch.last_seq
        if fork.sub_offset:
            batch = log.read(source.log_id, offset, 1)
            if not batch.events or not isinstance(batch.events[0], Payload):
                raise _bad_sub_offset("there is no record after the fork offset")
            events.append(_prefix(batch.events[0], fork.sub_offset, json_mode))
        return (source.path, offset, fork.sub_offset), events

    # -- append -----------------------------------------------------------------------------

    async def append(self, stream: DurableStream, request: Append) -> Appended:
        """Append (and close) as the protocol's rules say (module docstring); raises
        :class:`DurableStreamError` with the protocol's status."""
        async with stream.lock:  # validation and append as one step (section 5.2.1)
            if stream.gone:
                raise StreamNotFoundError(stream.path)
            log = self._hub.log
            producer = request.producer
            if stream.closed:
                tail = log.last_seq(stream.log_id)
                if producer is not None and stream.closed_by == (
                    producer.id,
                    producer.epoch,
                    producer.seq,
                ):
                    state = stream.producers.get(producer.id)
                    return Appended(204, tail, True, state)
                if not request.records:
                    return Appended(204, tail, True)
                raise DurableStreamError(
                    f"stream {stream.path!r} is closed",
                    stream_id=stream.path,
                    status=409,
                    headers=(*_CLOSED, ("Stream-Next-Offset", _offset(tail))),
                )
            accepted: tuple[int, int] | None = None
            if producer is not None:
                accepted = self._check_producer(stream, producer)
                if accepted is None:  # a duplicate: already appended
                    state = stream.producers.get(producer.id)
                    return Appended(204, log.last_seq(stream.log_id), False, state)
            if request.stream_seq is not None:
                last = stream.stream_seq
                if last is not None and request.stream_seq.encode() <= last.encode():
                    raise _conflict(stream.path, "Stream-Seq must increase")
            if request.records:
                await self._hub.append_stored(stream.log_id, request.records)
            if request.stream_seq is not None:
                stream.stream_seq = request.stream_seq
            if producer is not None and accepted is not None:
                producers = stream.producers
                producers.pop(producer.id, None)  # re-inserted: the most recent last
                if len(producers) >= MAX_PRODUCERS_PER_STREAM:
                    del producers[next(iter(producers))]
                producers[producer.id] = accepted
            if request.close:
                stream.closed = True
                if producer is not None:
                    stream.closed_by = (producer.id, producer.epoch, producer.seq)
            self._touch(stream)
            stream.wake_readers()
            next_seq = log.last_seq(stream.log_id)
            status = 200 if producer is not None and request.records else 204
            return Appended(status, next_seq, stream.closed, accepted)

    @staticmethod
    def _check_producer(stream: DurableStream, producer: ProducerRequest) -> tuple[int, int] | None:
        """The producer's state after this request, or ``None`` for a duplicate."""
        state = stream.producers.get(producer.id)
        if state is None:
            if producer.seq != 0:
                raise _gap(stream.path, 0, producer.seq)
            return producer.epoch, 0
        epoch, last_seq = state
        if producer.epoch < epoch:
            raise DurableStreamError(
                f"producer {producer.id!r}: epoch {producer.epoch} is stale",
                stream_id=stream.path,
                status=403,
                headers=(("Producer-Epoch", str(epoch)),),
            )
        if producer.epoch > epoch:
            if producer.seq != 0:
                raise InvalidParameterError("Producer-Seq: a new epoch starts at 0", "Producer-Seq")
            return producer.epoch, 0
        if producer.seq <= last_seq:
            return None
        if producer.seq != last_seq + 1:
            raise _gap(stream.path, last_seq + 1, producer.seq)
        return epoch, producer.seq

    # -- delete and expiry ------------------------------------------------------------------

    def delete(self, stream: DurableStream) -> None:
        """Delete the stream: soft while forks name it, else for good (and its source, if
        that was soft-deleted and this was its last fork, and so on up the chain)."""
        if stream.num_forks > 0:
            stream.deleted = True
            if stream.timer is not None:
                stream.timer.cancel()
                stream.timer = None
            stream.deadline = None
            stream.wake_readers()
            return
        self._drop(stream)
        self._hub.delete_stored(stream.log_id)

    def _drop(self, stream: DurableStream) -> None:
        """Forget the stream (its log is deleted, or evicted, by the hub), and release its
        source, which goes too if it was soft-deleted and this was its last fork."""
        stream.gone = True
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if self._streams.get((stream.tenant, stream.path)) is stream:
            del self._streams[(stream.tenant, stream.path)]
        self._by_log.pop(stream.log_id, None)
        stream.wake_readers()
        source = stream.source
        if source is not None and not source.gone:
            source.num_forks -= 1
            if source.deleted and source.num_forks == 0:
                self._drop(source)
                self._hub.delete_stored(source.log_id)

    def _evicted(self, log_id: str) -> None:
        """The memory budget evicted the stream's log: it is gone as if deleted."""
        stream = self._by_log.get(log_id)
        if stream is not None:
            self._drop(stream)

    def _touch(self, stream: DurableStream) -> None:
        """A read or write: the TTL starts again; (re)arm the expiry timer."""
        now_mono = time.monotonic()
        deadline: float | None = None
        if stream.ttl_s is not None:
            deadline = now_mono + stream.ttl_s
        if stream.expires_at is not None:
            at = now_mono + (stream.expires_at - time.time())
            deadline = at if deadline is None else min(deadline, at)
        stream.deadline = deadline
        if deadline is not None and stream.timer is None:
            loop = asyncio.get_running_loop()
            stream.timer = loop.call_at(_loop_time(deadline), self._timer_fired, stream)

    def _timer_fired(self, stream: DurableStream) -> None:
        stream.timer = None
        if stream.gone or stream.deleted or stream.deadline is None:
            return
        if time.monotonic() < stream.deadline:  # touched since: wait for the new deadline
            loop = asyncio.get_running_loop()
            stream.timer = loop.call_at(_loop_time(stream.deadline), self._timer_fired, stream)
            return
        self.delete(stream)  # expired: as if deleted

    # -- readers ----------------------------------------------------------------------------

    def open_reader(self, stream: DurableStream, after_seq: int) -> Reader:
        """A reader of the stream's log after event ``after_seq``; close it when done."""
        reader = Reader(self._hub.log, stream.log_id, after_seq, on_close=stream.readers.discard)
        stream.readers.add(reader)
        return reader


def _loop_time(deadline_mono: float) -> float:
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline_mono - time.monotonic())


def _media(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _same_time(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) < 0.001


def _offset(seq: int) -> str:
    return f"{seq:016d}_{0:016d}"


def _conflict(path: str, message: str) -> DurableStreamError:
    return DurableStreamError(f"stream {path!r}: {message}", stream_id=path, status=409)


def _gap(path: str, expected: int, received: int) -> DurableStreamError:
    return DurableStreamError(
        f"stream {path!r}: producer sequence gap: expected {expected}, got {received}",
        stream_id=path,
        status=409,
        headers=(
            ("Producer-Expected-Seq", str(expected)),
            ("Producer-Received-Seq", str(received)),
        ),
    )


def _bad_sub_offset(message: str) -> InvalidParameterError:
    return InvalidParameterError(f"Stream-Fork-Sub-Offset: {message}", "Stream-Fork-Sub-Offset")


def _prefix(record: Payload, count: int, json_mode: bool) -> Payload:
    """The first ``count`` bytes (JSON mode: messages) of a record."""
    if json_mode:
        if count > record.num_messages:
            raise _bad_sub_offset("past the record's messages")
        messages = json.loads(b"[" + record.data + b"]")
        return Payload(b",".join(compact_json(m) for m in messages[:count]), count)
    if count > len(record.data):
        raise _bad_sub_offset("past the record's bytes")
    return Payload(record.data[:count])
