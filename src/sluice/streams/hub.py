"""The stream hub: stream lifecycle, producers, readers, grace windows and cancellation.

One producer task per stream pulls deltas from a backend and appends neutral events to the
stream's log. Readers (one per client connection) replay the log from a position and
follow it live. Generation is decoupled from connections:

- a reader leaving a **non-resumable** stream that has no other reader cancels it at once;
- a **resumable** stream waits ``grace_s`` for a reader to come back, then is cancelled;
- a stream nobody ever reads is cancelled when its first grace window ends;
- a finished stream stays readable for ``retention_s``, then its log is deleted, unless
  it is evicted earlier to make room (see below).

Limits (:class:`HubSettings`), all decided before a stream's first event or enforced by its
producer:

- ``max_streams`` live streams on this server (``CapacityError``: 503). Retained streams
  count too, but a creation that finds the server full evicts one (its tenant's oldest,
  else the oldest of all), so finished streams never block a new one;
- ``max_streams_per_tenant`` live streams per tenant (``TenantLimitError``: 429);
- ``log_budget_bytes`` for all event logs, live and retained, ``max_log_bytes_per_tenant``
  for one tenant's, ``max_retained_per_tenant`` finished streams per tenant: the
  :class:`~sluice.streams.budget.LogBudget` evicts retained streams oldest first (its
  docstring has the order), refuses a creation that cannot fit (``CapacityError``
  ``log_memory``: 503; over the tenant's bytes, ``TenantLimitError``: 429), and has a live
  stream that appends past a bound trim its oldest records (a reader behind them gets
  ``resume_gap``). An evicted stream is gone as if its retention had ended;
- ``max_tokens_per_stream``: a request asking for more is clamped to it, and a backend
  whose own default is larger is stopped there; the stream ends with ``Finished(length)``;
- ``max_stream_s`` from creation to the terminal event: the generation is aborted and the
  stream ends with ``usage`` then ``Finished(length)``. A duration cap, like a token cap,
  cuts the output short without making what was sent wrong, so it is reported the way
  every client already handles a cut (OpenAI ``finish_reason: "length"``, Anthropic
  ``max_tokens``), not as an error that SDKs raise and whose text they drop.
  ``StreamObserver.limited`` tells metrics which limit it was.

**Stored logs** (:meth:`StreamHub.open_stored`): a log no generation writes, whose records a
client appends (a durable stream's, :mod:`sluice.streams.durable`). It is in the same log and
budget as every stream's and counts as a retained one: evictable, oldest first, with the
same bounds; the hub never cancels or expires it (its owner deletes it), and tells its
owner when the budget evicts it.

Producer tasks live in the hub's task group (entered by :meth:`StreamHub.running`); grace
and retention are loop timers, not tasks, so a held idle stream costs no task of its own
beyond its producer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sluice.backends.base import Backend, Generation, GenerationRequest
from sluice.errors import (
    BackendError,
    BadRequestError,
    CapacityError,
    ResumeGapError,
    StreamNotFoundError,
    TenantLimitError,
    UnknownModelError,
)
from sluice.events import (
    Error,
    Finished,
    FinishReason,
    NeutralEvent,
    RenderMeta,
    Started,
    Usage,
)
from sluice.streams.budget import LOG_MEMORY, TENANT_LOG_BYTES, LogBudget
from sluice.streams.ids import new_stream_id
from sluice.streams.log import EventLog
from sluice.streams.reader import DeliveryObserver, Reader, wait_for_record
from sluice.streams.sizing import LOG_BYTES
from sluice.streams.state import TERMINAL_STATES, StreamState, next_state

__all__ = ["HubSettings", "Stream", "StreamHub", "StreamObserver"]

logger = logging.getLogger("sluice.streams")

# A producer whose backend never suspends yields the loop after this many deltas anyway,
# so readers and other producers get their turn.
_YIELD_EVERY_DELTAS = 16


@dataclass(frozen=True, slots=True)
class HubSettings:
    """Limits and windows of the hub."""

    default_grace_s: float = 15.0
    max_grace_s: float = 3600.0
    retention_s: float = 300.0
    max_streams: int = 100_000
    # Live streams one tenant may hold at once (each may pin a model slot).
    max_streams_per_tenant: int = 1_000
    # Memory of all event logs, live and retained (as sluice.streams.sizing counts it): a
    # 24 GB host keeps 1 GiB for the logs beside the process, a model and its KV cache.
    log_budget_bytes: int = 1024 * 1024 * 1024
    # One tenant's logs, live and retained: a quarter of the budget, so one tenant leaves
    # room for at least three others.
    max_log_bytes_per_tenant: int = 256 * 1024 * 1024
    # Finished streams one tenant keeps readable; past it, its oldest is evicted.
    max_retained_per_tenant: int = 10_000
    # Token events one stream may produce: the log's default record bound, so a whole
    # stream stays resumable from its first event.
    max_tokens_per_stream: int = 100_000
    # Creation to terminal event; long enough for any sane generation, short enough that a
    # runaway one (an upstream that never ends) does not hold its slot for a day.
    max_stream_s: float = 3600.0
    # What a refused client is told to wait (``Retry-After``) when a limit of the hub is hit.
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.default_grace_s <= self.max_grace_s:
            raise ValueError("default_grace_s must be between 0 and max_grace_s")
        if self.retention_s < 0:
            raise ValueError("retention_s must not be negative")
        if self.max_streams < 1:
            raise ValueError("max_streams must be at least 1")
        if self.max_streams_per_tenant < 1:
            raise ValueError("max_streams_per_tenant must be at least 1")
        if self.log_budget_bytes < 1 or self.max_log_bytes_per_tenant < 1:
            raise ValueError("log_budget_bytes and max_log_bytes_per_tenant must be positive")
        if self.max_retained_per_tenant < 1:
            raise ValueError("max_retained_per_tenant must be at least 1")
        if self.max_tokens_per_stream < 1:
            raise ValueError("max_tokens_per_stream must be at least 1")
        if not self.max_stream_s > 0:
            raise ValueError("max_stream_s must be positive")
        if self.retry_after_s < 0:
            raise ValueError("retry_after_s must not be negative")


class StreamObserver(DeliveryObserver, Protocol):
    """Told what every stream does, for metrics (and, through its readers, what the
    transports do to their clients); each call must be quick and not raise."""

    def started(self, stream: Stream, queued_s: float) -> None:
        """The backend admitted the work ``queued_s`` after the stream was created."""

    def tokens(self, stream: Stream, count: int, since_s: float, first: bool) -> None:
        """``count`` token events arrived, ``since_s`` after the creation (``first``) or
        after the previous ones."""

    def finished(self, stream: Stream, outcome: str, e2e_s: float) -> None:
        """The stream ended: ``stop``, ``length``, ``tool_calls``, ``cancelled``,
        ``client_gone`` or ``error``."""

    def limited(self, stream: Stream, limit: str) -> None:
        """A limit of the hub ended the stream: ``max_tokens`` or ``max_duration``."""

    def refused(self, stream: Stream, reason: str) -> None:
        """The backend refused the work in ``start()`` (``CapacityError.reason``)."""

    def evicted(self, stream: Stream, reason: str) -> None:
        """A retained stream was dropped before its retention ended, to make room:
        ``log_memory``, ``tenant_log_bytes``, ``tenant_retained_streams`` or
        ``max_streams``."""


@dataclass(slots=True, eq=False)
class Stream:
    """The hub's record of one stream."""

    id: str
    model: str
    resumable: bool
    grace_s: float
    created: float
    # Who created it (an API key's tenant); only they, or a resume token, may read it.
    tenant: str = "anonymous"
    state: StreamState = StreamState.QUEUED
    readers: list[Reader] = field(default_factory=list, repr=False)
    num_events: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None
    cancel_requested: bool = False
    generation: Generation | None = None
    task: asyncio.Task[None] | None = None
    # How the stream's readers render it when it was created in a dialect other than the
    # native one (set by the gateway; kept, not read, here): a resume renders the same.
    render: RenderMeta | None = None
    # Why a cancel was asked for: "cancelled" (on request) or "client_gone" (no reader).
    cancel_cause: str = "cancelled"
    admitted: bool = False  # the backend's start() succeeded
    # Why the backend refused the work in start(), with its ``retry_after_s``.
    refusal: CapacityError | None = None
    usage: Usage | None = None  # the ``Usage`` it ended with, for the observer's finished()
    # Its ``Started`` event once admitted (its creator may look after the log dropped it).
    started: Started | None = None
    # time.monotonic() at creation, for the observer's latencies.
    created_mono: float = field(default_factory=time.monotonic, repr=False)
    # The grace window while live; the retention window once terminal.
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    # ``max_stream_s`` after creation, while live.
    deadline: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary for ``GET /v1/streams/{id}``."""
        return {
            "id": self.id,
            "model": self.model,
            "state": self.state.value,
            "resumable": self.resumable,
            "created": int(self.created),
            "events": self.num_events,
            "tokens": self.num_tokens,
            "readers": len(self.readers),
            "finish_reason": self.finish_reason,
        }


@dataclass(frozen=True, slots=True)
class _StoredLog:
    """A stored log's owner: its tenant, and what to call when the budget evicts it."""

    tenant: str
    on_evicted: Callable[[str], None]


def _log_fields(stream: Stream) -> dict[str, object]:
    """The ``extra=`` of a log record about ``stream`` (fields of the JSON log lines)."""
    return {"stream_id": stream.id, "model": stream.model, "tenant": stream.tenant}


class StreamHub:
    """Creates streams, runs their producers, and hands out readers."""

    def __init__(
        self,
        log: EventLog,
        backends: Mapping[str, Backend],
        settings: HubSettings | None = None,
        observer: StreamObserver | None = None,
    ) -> None:
        self._log = log
        self._observer = observer
        self._draining = False
        self._changed: asyncio.Event | None = None  # set when a stream ends (drain waits)
        self._backends = dict(backends)
        self.settings = settings or HubSettings()
        self._streams: dict[str, Stream] = {}
        self._stored: dict[str, _StoredLog] = {}  # by log id (see open_stored)
        settings = self.settings
        self._budget = LogBudget(
            budget_bytes=settings.log_budget_bytes,
            max_bytes_per_tenant=settings.max_log_bytes_per_tenant,
            max_retained_per_tenant=settings.max_retained_per_tenant,
        )
        self._task_group: asyncio.TaskGroup | None = None

    @property
    def log(self) -> EventLog:
        return self._log

    @property
    def memory(self) -> LogBudget:
        """What the event logs hold, per tenant and in all, and the evictions so far."""
        return self._budget

    @property
    def backends(self) -> Mapping[str, Backend]:
        return self._backends

    @property
    def models(self) -> list[str]:
        return list(self._backends)

    @property
    def running_now(self) -> bool:
        """True inside :meth:`running` (the app's lifespan)."""
        return self._task_group is not None

    @property
    def draining(self) -> bool:
        """True once :meth:`drain` began: new streams are refused."""
        return self._draining

    def live_streams(self) -> list[Stream]:
        return [stream for stream in self._streams.values() if not stream.is_terminal]

    async def drain(self, timeout_s: float) -> None:
        """Refuse new streams, let live ones finish for up to ``timeout_s``, then end the rest
        on an event boundary with a retryable ``unavailable`` error (their clients retry
        elsewhere) and wait for their producers to write it."""
        self._draining = True
        changed = self._changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.live_streams() and (left := deadline - loop.time()) > 0:
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)
        self.end_live_streams()
        while self.live_streams():
            changed.clear()
            await changed.wait()

    def end_live_streams(self) -> int:
        """End every live stream now, as :meth:`drain` does at its deadline: each one's
        producer writes a retryable ``unavailable`` error. Returns how many."""
        live = self.live_streams()
        for stream in live:
            stream.cancel_cause = "shutdown"
            self.cancel(stream.id)
        return len(live)

    def __len__(self) -> int:
        return len(self._streams)

    def num_live(self, tenant: str) -> int:
        """Live streams ``tenant`` holds now."""
        return self._budget.num_live_of(tenant)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[StreamHub]:
        """Own the producers' task group; on exit cancel every live stream and wait."""
        async with asyncio.TaskGroup() as task_group:
            self._task_group = task_group
            try:
                yield self
            finally:
                for stream in list(self._streams.values()):
                    self.cancel(stream.id)
                self._task_group = None
        for stream in list(self._streams.values()):
            if stream.timer is not None:
                stream.timer.cancel()
            if stream.deadline is not None:
                stream.deadline.cancel()
        self._streams.clear()
        self._stored.clear()
        self._budget.clear()
        await self._log.aclose()

    # ------------------------------------------------------------------ lifecycle

    async def create(
        self,
        model: str,
        request: GenerationRequest,
        *,
        resumable: bool = True,
        grace_s: float | None = None,
        tenant: str = "anonymous",
        stream_id: str | None = None,
    ) -> Stream:
        """Start a stream for ``tenant``; its producer runs until the end, a cancel, or a
        failure. ``stream_id`` is a fresh id the caller made (a shared registry names the
        stream before it exists); by default the hub makes one."""
        if self._task_group is None:
            raise RuntimeError("StreamHub.create() outside StreamHub.running()")
        if self._draining:
            raise CapacityError("the server is shutting down", retry_after_s=1.0)
        backend = self._backends.get(model)
        if backend is None:
            known = ", ".join(sorted(self._backends))
            raise UnknownModelError(f"unknown model {model!r}; this server serves: {known}")
        if grace_s is None:
            grace_s = self.settings.default_grace_s
        if not 0 <= grace_s <= self.settings.max_grace_s:
            raise BadRequestError(f"grace_s must be between 0 and {self.settings.max_grace_s}")
        settings = self.settings
        budget = self._budget
        if budget.num_live >= settings.max_streams:
            raise CapacityError(
                "too many streams on this server", retry_after_s=settings.retry_after_s
            )
        num_live = budget.num_live_of(tenant)
        if num_live >= settings.max_streams_per_tenant:
            raise TenantLimitError(
                f"tenant {tenant!r} holds {num_live} live streams, its maximum",
                tenant=tenant,
                retry_after_s=settings.retry_after_s,
            )
        refusal = budget.refusal(tenant)
        if refusal == TENANT_LOG_BYTES:
            raise TenantLimitError(
                f"the live streams of tenant {tenant!r} hold "
                f"{budget.bytes_of(tenant) / 2**20:.0f} MiB of event logs, its maximum",
                tenant=tenant,
                retry_after_s=settings.retry_after_s,
            )
        if refusal == LOG_MEMORY:
            raise CapacityError(
                "the event logs of the live streams fill this server's memory budget",
                retry_after_s=settings.retry_after_s,
                reason=LOG_MEMORY,
            )
        await self._make_room_for_new(tenant)
        if request.max_tokens is not None and request.max_tokens > settings.max_tokens_per_stream:
            request = dataclasses.replace(request, max_tokens=settings.max_tokens_per_stream)
        stream = Stream(
            id=stream_id or new_stream_id(),
            model=model,
            resumable=resumable,
            grace_s=grace_s,
            created=time.time(),
            tenant=tenant,
        )
        await self._log.create(stream.id)
        self._streams[stream.id] = stream
        budget.opened(stream.id, tenant, self._log.num_bytes(stream.id))
        stream.generation = backend.generate(request)
        # Nobody is reading yet: the first reader has one grace window to arrive.
        self._arm_grace(stream)
        loop = asyncio.get_running_loop()
        stream.deadline = loop.call_later(settings.max_stream_s, self._too_long, stream.id)
        stream.task = self._task_group.create_task(self._produce(stream, stream.generation))
        return stream

    async def first_event(self, stream_id: str) -> NeutralEvent:
        """The stream's first event, once it exists: ``Started``, or the ``Error`` of a
        backend that refused the work (see ``Generation.start``)."""
        stream = self._streams.get(stream_id)
        while True:
            try:
                batch = self._log.read(stream_id, 0, 1)
            except (ResumeGapError, StreamNotFoundError):
                # Trimmed or evicted before its creator looked: it started, if admitted.
                if stream is None or stream.started is None:
                    raise
                return stream.started
            if batch.events:
                return batch.events[0]
            await wait_for_record(self._log, stream_id, 0)

    async def attach(self, stream_id: str) -> None:
        """Make a stream that another replica runs known here, if there is one, before a
        request looks it up with :meth:`get` (nothing to do for a hub of one process; see
        :class:`~sluice.streams.redis_hub.RedisStreamHub`)."""

    def get(self, stream_id: str) -> Stream:
        stream = self._streams.get(stream_id)
        if stream is None:
            raise StreamNotFoundError(stream_id)
        return stream

    def cancel(self, stream_id: str) -> Stream:
        """Cancel a live stream (idempotent); its producer ends it with ``done: cancelled``."""
        stream = self.get(stream_id)
        if stream.is_terminal or stream.cancel_requested:
            return stream
        stream.cancel_requested = True
        # A queued producer has not started: it sees the flag on its first step instead (a
        # task cancelled before it starts would never write its terminal event).
        if stream.state is not StreamState.QUEUED and stream.task is not None:
            stream.task.cancel()
        return stream

    # ------------------------------------------------------------------ readers

    def open_reader(self, stream_id: str, after_seq: int) -> Reader:
        """Attach a reader that starts after event ``after_seq``; close it when done."""
        stream = self.get(stream_id)
        if stream.timer is not None and not stream.is_terminal:
            stream.timer.cancel()  # the grace window: a reader is here
            stream.timer = None
        reader = Reader(
            self._log, stream_id, after_seq, on_close=self._reader_left, model=stream.model
        )
        reader.delivery = self._observer
        stream.readers.append(reader)
        return reader

    def drop_connections(self, stream_id: str) -> int:
        """End every connection reading the stream (they resume); return how many."""
        stream = self.get(stream_id)
        readers = list(stream.readers)  # an interrupted reader may close, and leave, at once
        for reader in readers:
            reader.interrupt()
        return len(readers)

    def _reader_left(self, reader: Reader) -> None:
        stream = self._streams.get(reader.stream_id)
        if stream is None:
            return
        stream.readers.remove(reader)
        if stream.readers or stream.is_terminal:
            return
        if stream.resumable and stream.grace_s > 0:
            self._arm_grace(stream)
        else:
            stream.cancel_cause = "client_gone"
            self.cancel(reader.stream_id)

    def _arm_grace(self, stream: Stream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
        loop = asyncio.get_running_loop()
        stream.timer = loop.call_later(stream.grace_s, self._grace_over, stream.id)

    def _too_long(self, stream_id: str) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.is_terminal:
            return
        stream.deadline = None
        logger.info(
            "stream %s: longer than %.0f s, ending it",
            stream_id,
            self.settings.max_stream_s,
            extra=_log_fields(stream),
        )
        stream.cancel_cause = "max_duration"
        self.cancel(stream_id)

    def _grace_over(self, stream_id: str) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        stream.timer = None
        if not stream.readers:
            logger.info(
                "stream %s: no reader within %.1f s, cancelling",
                stream_id,
                stream.grace_s,
                extra=_log_fields(stream),
            )
            stream.cancel_cause = "client_gone"
            self.cancel(stream_id)

    # ------------------------------------------------------------------ producer

    async def _append(self, stream: Stream, event: NeutralEvent) -> None:
        await self._log.append(stream.id, (event,))
        stream.num_events += 1
        if self._budget.resized(stream.id, self._log.num_bytes(stream.id)):
            await self._make_room(stream)

    # ------------------------------------------------------------------ stored logs

    async def open_stored(self, tenant: str, on_evicted: Callable[[str], None]) -> str:
        """A new empty log for ``tenant`` that no generation writes (see the module
        docstring); returns its id. Refused as a stream's creation is when the live
        streams fill the budget; ``on_evicted(log_id)`` is called if the budget evicts it."""
        if self._draining:
            raise CapacityError("the server is shutting down", retry_after_s=1.0)
        budget = self._budget
        settings = self.settings
        refusal = budget.refusal(tenant)
        if refusal == TENANT_LOG_BYTES:
            raise TenantLimitError(
                f"the live streams of tenant {tenant!r} fill its share of the event logs",
                tenant=tenant,
                retry_after_s=settings.retry_after_s,
            )
        if refusal is not None:
            raise CapacityError(
                "the event logs of the live streams fill this server's memory budget",
                retry_after_s=settings.retry_after_s,
                reason=refusal,
            )
        await self._make_room_for_new(tenant)
        log_id = new_stream_id()
        await self._log.create(log_id)
        self._stored[log_id] = _StoredLog(tenant, on_evicted)
        budget.opened(log_id, tenant, self._log.num_bytes(log_id))
        for victim in budget.retain(log_id):
            await self._evict(*victim)
        return log_id

    async def append_stored(self, log_id: str, events: Sequence[NeutralEvent]) -> int:
        """Append to a stored log; returns the seq of the last event. Retained streams of
        its tenant (then of all) are evicted when the budget needs room, never this log."""
        last_seq = await self._log.append(log_id, events)
        owner = self._stored.get(log_id)
        budget = self._budget
        if owner is not None and budget.resized(log_id, self._log.num_bytes(log_id)):
            while (victim := budget.victim(owner.tenant)) is not None and victim[0] != log_id:
                await self._evict(*victim)
        return last_seq

    def delete_stored(self, log_id: str) -> None:
        """Delete a stored log (idempotent): it leaves the budget now, and its log is
        deleted in the hub's task group (as a finished stream's is when its retention ends)."""
        if self._stored.pop(log_id, None) is not None:
            self._budget.forget(log_id)
            if self._task_group is not None:
                self._task_group.create_task(self._log.delete(log_id))

    # ------------------------------------------------------------------ memory

    async def _make_room_for_new(self, tenant: str) -> None:
        """Evict what a new stream of ``tenant`` needs gone (its caller checked that
        evicting is enough): retained streams over the budgets, then one if the server
        holds ``max_streams``."""
        budget = self._budget
        while (victim := budget.victim(tenant, LOG_BYTES)) is not None:
            await self._evict(*victim)
        while len(self._streams) >= self.settings.max_streams:
            oldest = budget.oldest(tenant)
            if oldest is None:  # pragma: no cover - live streams are under max_streams
                break
            await self._evict(oldest, "max_streams")

    async def _make_room(self, stream: Stream) -> None:
        """``stream`` grew past a bound: evict retained streams, oldest first, and if that is
        not enough, trim the stream's own oldest records."""
        budget = self._budget
        while (victim := budget.victim(stream.tenant)) is not None:
            await self._evict(*victim)
        target = budget.trim_target(stream.id)
        if target is not None:
            self._log.trim(stream.id, target)
            budget.resized(stream.id, self._log.num_bytes(stream.id))
            budget.num_trims += 1

    async def _evict(self, stream_id: str, reason: str) -> None:
        """Drop a retained stream before its retention ends, as if it had ended."""
        stored = self._stored.pop(stream_id, None)
        if stored is not None:
            self._budget.forget(stream_id, evicted_for=reason)
            logger.debug("stored log %s: evicted (%s)", stream_id, reason)
            stored.on_evicted(stream_id)
            await self._log.delete(stream_id)
            return
        stream = self._streams.pop(stream_id)
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        self._budget.forget(stream_id, evicted_for=reason)
        logger.debug("stream %s: evicted (%s)", stream_id, reason, extra=_log_fields(stream))
        if self._observer is not None:
            self._observer.evicted(stream, reason)
        await self._log.delete(stream_id)

    async def _produce(self, stream: Stream, generation: Generation) -> None:
        """Run one generation into the log; always ends with exactly one terminal event."""
        final: list[NeutralEvent]
        try:
            if stream.cancel_requested:
                raise asyncio.CancelledError
            stream.state = next_state(stream.id, stream.state, StreamState.RUNNING)
            await generation.start()  # admission: a refusal is the stream's first event
            stream.admitted = True
            observer = self._observer
            if observer is not None:
                observer.started(stream, time.monotonic() - stream.created_mono)
            prompt_tokens = generation.usage().prompt_tokens  # known once admitted
            stream.started = Started(stream.model, int(stream.created), prompt_tokens)
            await self._append(stream, stream.started)
            reason = FinishReason.STOP
            stop_sequence: str | None = None
            num_deltas = 0
            append = self._log.append
            log_bytes = self._log.num_bytes
            resized = self._budget.resized
            last = stream.created_mono  # so the first token's interval is its TTFT
            max_tokens = self.settings.max_tokens_per_stream
            async for delta in generation:
                events = delta.events
                capped = False
                left = max_tokens - stream.num_tokens
                if len(events) >= left and (len(events) > left or delta.finish_reason is None):
                    events = events[:left]  # the hub's limit is under the backend's
                    capped = True
                if events:
                    if observer is not None:
                        now = time.monotonic()
                        observer.tokens(stream, len(events), now - last, not stream.num_tokens)
                        last = now
                    # Not waiting for a remote log to store them (log.EventLog.append):
                    # readers get them once stored; a failure is raised by the next append.
                    await append(stream.id, events, wait=False)
                    stream.num_events += len(events)
                    stream.num_tokens += len(events)
                    if resized(stream.id, log_bytes(stream.id)):
                        await self._make_room(stream)
                if capped:
                    stream.task = None
                    await generation.abort()
                    if observer is not None:
                        observer.limited(stream, "max_tokens")
                    reason = FinishReason.LENGTH
                    break
                if delta.finish_reason is not None:
                    reason, stop_sequence = delta.finish_reason, delta.stop_sequence
                num_deltas += 1
                if num_deltas % _YIELD_EVERY_DELTAS == 0:
                    await asyncio.sleep(0)
            stream.task = None  # finishing by itself now: a cancel from here on is too late
            await self._log.sync(stream.id)  # every token stored, or the failure raised here
            final = [generation.usage(), Finished(reason, stop_sequence)]
            target = StreamState.FINISHED
        except asyncio.CancelledError:
            stream.task = None
            await generation.abort()
            if not stream.cancel_requested:
                raise  # the hub itself is being torn down
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the cancel was ours, for this stream: it ends here
            if stream.cancel_cause == "shutdown":
                message = "the server is shutting down; retry the request"
                final = [generation.usage(), Error("unavailable", message, True)]
                target = StreamState.FAILED
            elif stream.cancel_cause == "max_duration":
                if self._observer is not None:
                    self._observer.limited(stream, "max_duration")
                final = [generation.usage(), Finished(FinishReason.LENGTH)]
                running = stream.state is StreamState.RUNNING
                target = StreamState.FINISHED if running else StreamState.CANCELLED
            else:
                final = [generation.usage(), Finished(FinishReason.CANCELLED)]
                target = StreamState.CANCELLED
        except BackendError as exc:
            stream.task = None
            await generation.abort()
            final = [Error("backend_error", str(exc), exc.retryable)]
            target = StreamState.FAILED
        except CapacityError as exc:  # a backend refused the work when it started
            stream.task = None
            stream.refusal = exc
            if self._observer is not None:
                self._observer.refused(stream, exc.reason)
            await generation.abort()
            final = [Error("overloaded", str(exc), True)]
            target = StreamState.FAILED
        except BadRequestError as exc:
            stream.task = None
            await generation.abort()
            final = [Error("invalid_request", str(exc), False)]
            target = StreamState.FAILED
        except Exception:
            stream.task = None
            logger.exception("stream %s: producer failed", stream.id, extra=_log_fields(stream))
            await generation.abort()
            final = [Error("internal_error", "the stream failed inside the server", False)]
            target = StreamState.FAILED
        await self._finish(stream, final, target)

    async def _finish(self, stream: Stream, final: list[NeutralEvent], target: StreamState) -> None:
        try:
            for event in final:
                await self._append(stream, event)
                if isinstance(event, Usage):
                    stream.usage = event
        except BackendError as exc:  # the log did not take its tokens or its end (Redis)
            final = [Error("backend_error", str(exc), exc.retryable)]
            target = StreamState.FAILED
            await self._append(stream, final[0])  # the stream is local now: this one stays
        terminal = final[-1]
        if isinstance(terminal, Finished):
            stream.finish_reason = terminal.reason.value
        else:
            stream.finish_reason = "error"
        if self._changed is not None:
            self._changed.set()
        if self._observer is not None:
            outcome = stream.finish_reason
            if outcome == FinishReason.CANCELLED.value:
                outcome = stream.cancel_cause
            self._observer.finished(stream, outcome, time.monotonic() - stream.created_mono)
        stream.state = next_state(stream.id, stream.state, target)
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if stream.deadline is not None:
            stream.deadline.cancel()
            stream.deadline = None
        stream.generation = None
        loop = asyncio.get_running_loop()
        stream.timer = loop.call_later(self.settings.retention_s, self._forget, stream.id)
        for victim in self._budget.retain(stream.id):  # its tenant's oldest, over its count
            await self._evict(*victim)

    def _forget(self, stream_id: str) -> None:
        """Retention is over: forget the stream, then delete its log."""
        stream = self._streams.pop(stream_id, None)
        self._budget.forget(stream_id)
        if stream is not None and self._task_group is not None:
            self._task_group.create_task(self._log.delete(stream_id))
