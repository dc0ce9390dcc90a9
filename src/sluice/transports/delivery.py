"""The delivery core: one reader's records to one client connection, decided without I/O.

Sans-IO in the manner of h11 and anyio's memory streams: the core is told what happened
and answers with the bytes to write; its attributes say what to do next. It has no event
loop, socket, task or timer of its own. Inputs (``now`` is ``time.monotonic()``):

=========================  ===============================================================
``start(now)``             the response head went out: the ``retry:`` hint and what is ready
``on_records(now)``        the reader was woken (records, an interrupt): what is ready
``on_timer(now)``          a timer fired (at ``wake_at`` or earlier: the core checks)
``on_paused(now)``         the sink stopped taking bytes (a full transport buffer)
``on_resumed(now)``        the sink drained
``on_stalled()``           the sink took nothing for ``send_timeout_s`` (a shell that waits
                           on its sends says so itself)
``interrupt()``            the server wants the connection to end (shutdown, drop)
``close()``                the peer is gone: detach, write nothing
=========================  ===============================================================

Outputs: the bytes each input returns (body bytes; the shell frames them: chunked or
raw), and ``waiting`` (caught up: watch the reader, call ``on_records`` when it wakes),
``wake_at`` (when to call ``on_timer``), ``ended`` (:attr:`Ending.CLEAN`: complete the
response, the connection may be kept; :attr:`Ending.UNCLEAN`: cut the connection, the
client did not get the end and may resume). Ending closes the reader (the hub may then
cancel the stream).

The rules, each written only here:

- **Order.** The ``retry:`` hint first, for dialects that want one (native); then the
  reader's records as their encoded frames (:mod:`sluice.transports.frames`), at most
  ``max_batch_records`` per write; the end after the terminal event. A position the log
  no longer holds gets the dialect's in-band ``resume_gap`` error, then the end; a log
  deleted underneath just ends.
- **Coalescing.** A connection whose sink paused is *lagging* until it catches up with
  the log; while lagging, each run of consecutive ``token`` events in a read is sent as
  ONE event carrying their joined text, with the id of the last of them, so a resume from
  that id is still exact. Only where the dialect can merge tokens (the native one; the
  compatible dialects' renderers are stateful, their frames go as rendered). A client
  that keeps up sees one event per token, exactly as appended.
- **Heartbeats.** A ``: ping`` comment line when nothing was written for
  ``heartbeat_interval_s`` (never while paused: a paused sink takes nothing).
- **Send timeout.** A sink paused for ``send_timeout_s`` ends the connection unclean, and
  its reader leaves, so a non-resumable stream left without readers is cancelled by the
  hub: a stuck client never pins a model slot.
- **Token gap metric.** Each write that carries token events reports the gap since the
  previous such write (``DeliveryObserver.token_write_gap``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.errors import ResumeGapError, StreamNotFoundError
from sluice.events import NeutralEvent, TextDelta, ToolCallDelta
from sluice.sse import encode_comment, encode_retry
from sluice.streams.log import Batch
from sluice.streams.reader import Reader
from sluice.transports.frames import FrameSource

__all__ = ["PING", "Delivery", "DeliveryOptions", "Ending", "kernel_write_deadline_s"]

# ``: ping\n``, a bare comment line: no blank line follows it, so no SSE parser (the SDKs'
# included) dispatches an empty event for it (see :mod:`sluice.sse.encoder`, choice 6).
# Frames are whole blocks, so a ping is always written where a line begins.
PING = encode_comment("ping")

# How much longer than the send timeout (or two heartbeats) the kernel keeps unacknowledged
# data before it resets the connection: a live but stuck peer (zero window) meets the send
# timeout, and its metric, first.
_KERNEL_SLACK_S = 5.0


@dataclass(frozen=True, slots=True)
class DeliveryOptions:
    """How one connection's delivery behaves."""

    # Below the 30-60 s idle timeouts of common proxies and load balancers.
    heartbeat_interval_s: float = 15.0
    # The reconnection delay EventSource should use after a drop.
    retry_ms: int = 1000
    # Frames joined into one write when a reader is behind (bounds a single write's size).
    max_batch_records: int = 512
    # A connection whose sink takes nothing for this long is closed (it may resume): two
    # default heartbeat intervals, under the 60 s idle timeouts of common proxies.
    send_timeout_s: float = 30.0
    # Merge a lagging reader's consecutive token events (where the dialect can).
    coalesce: bool = True

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be positive")
        if self.retry_ms < 0:
            raise ValueError("retry_ms must not be negative")
        if self.max_batch_records < 1:
            raise ValueError("max_batch_records must be at least 1")
        if not self.send_timeout_s > 0:
            raise ValueError("send_timeout_s must be positive")


def kernel_write_deadline_s(options: DeliveryOptions) -> float:
    """How long a connection's socket may hold unacknowledged data before the kernel resets
    it (``TCP_USER_TIMEOUT``). A peer gone without a FIN never fills the buffer (heartbeats
    are small), so only the kernel notices it: after two heartbeats, or the send timeout if
    longer, plus a margin so that a live but stuck peer meets the send timeout first
    (defaults: 35 s)."""
    return max(2 * options.heartbeat_interval_s, options.send_timeout_s) + _KERNEL_SLACK_S


class Ending(enum.Enum):
    """How a connection's delivery ended."""

    CLEAN = "clean"  # the response is whole: complete it (the connection may be kept)
    UNCLEAN = "unclean"  # cut the connection: the client did not get the end


def _has_tokens(events: Sequence[NeutralEvent]) -> bool:
    """Whether ``events`` holds a token event. A stream's token events are contiguous
    after its one ``Started``, so the scan of a read with tokens stops at its first or
    second event."""
    for event in events:
        kind = type(event)
        if kind is TextDelta or kind is ToolCallDelta:
            return True
    return False


class Delivery:
    """One reader's records to one connection (see the module docstring)."""

    __slots__ = (
        "_frames",
        "_lagging",
        "_last_token_write",
        "_last_write",
        "_options",
        "_paused",
        "_stall_at",
        "ended",
        "reader",
        "waiting",
    )

    def __init__(self, reader: Reader, frames: FrameSource, options: DeliveryOptions) -> None:
        self.reader = reader
        self._frames = frames
        self._options = options
        self._last_write = 0.0  # ``now`` of the last write
        self._last_token_write = 0.0  # ... of the last write with token events (0: none)
        self._paused = False
        self._lagging = False  # paused since it last caught up with the log: coalesce
        self._stall_at = 0.0  # when a paused sink meets the send timeout
        self.waiting = False
        self.ended: Ending | None = None

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def wake_at(self) -> float:
        """When ``on_timer`` has something to do: the send timeout while paused, else the
        next heartbeat."""
        if self._paused:
            return self._stall_at
        return self._last_write + self._options.heartbeat_interval_s

    # ------------------------------------------------------------------ inputs

    def start(self, now: float) -> bytes:
        self._last_write = now
        body = self.on_records(now)
        if self._frames.retry_hint:
            return encode_retry(self._options.retry_ms) + body
        return body

    def on_records(self, now: float) -> bytes:
        if self.ended is not None or self._paused:
            self.waiting = False
            return b""
        self.waiting = False
        reader = self.reader
        if reader.interrupted:
            self._end(Ending.CLEAN)
            return b""
        max_records = self._options.max_batch_records
        try:
            batch = reader.read(max_records)
        except ResumeGapError as exc:
            reader.done = True
            body = self._frames.refusal("resume_gap", str(exc), exc.after_seq)
            self._end(Ending.CLEAN)
            return body
        except StreamNotFoundError:
            reader.done = True  # expired under us: nothing more will come
            self._end(Ending.CLEAN)
            return b""
        events = batch.events
        if not events:
            self._caught_up()
            return b""
        merged = self._coalesced(batch) if self._lagging and len(events) > 1 else None
        body = self._frames.body(batch) if merged is None else merged
        self._last_write = now
        delivery = reader.delivery
        if delivery is not None and _has_tokens(events):
            if self._last_token_write:
                delivery.token_write_gap(reader.model, now - self._last_token_write)
            self._last_token_write = now
        if reader.done:
            self._end(Ending.CLEAN)
        elif len(events) < max_records:
            self._caught_up()  # it read all there is: nothing more until the log wakes it
        return body

    def on_timer(self, now: float) -> bytes:
        if self.ended is not None:
            return b""
        if self._paused:
            if now >= self._stall_at:
                self.on_stalled()
            return b""
        if now - self._last_write >= self._options.heartbeat_interval_s:
            self._last_write = now
            return PING
        return b""

    def on_paused(self, now: float) -> None:
        if self._paused or self.ended is not None:
            return
        self._paused = True
        self._lagging = self._options.coalesce
        self._stall_at = now + self._options.send_timeout_s

    def on_resumed(self, now: float) -> None:
        self._paused = False

    def on_stalled(self) -> None:
        if self.ended is not None:
            return
        delivery = self.reader.delivery
        if delivery is not None:
            delivery.send_timed_out()
        self._end(Ending.UNCLEAN)  # the reader leaves: a non-resumable stream is cancelled

    def interrupt(self) -> None:
        """End on an event boundary: the reader is interrupted (a watching shell is woken
        and its next ``on_records`` ends clean); a paused sink is cut at once."""
        self.reader.interrupt()
        if self._paused and self.ended is None:
            self._end(Ending.UNCLEAN)

    def close(self) -> None:
        """The peer is gone (idempotent)."""
        if self.ended is None:
            self._end(Ending.UNCLEAN)

    # ------------------------------------------------------------------ internals

    def _caught_up(self) -> None:
        self._lagging = False
        self.waiting = True

    def _end(self, ending: Ending) -> None:
        self.ended = ending
        self.waiting = False
        self.reader.close()

    def _coalesced(self, batch: Batch) -> bytes | None:
        """The frames of ``batch`` with each run of consecutive token events as one merged
        frame (the id of the run's last event); ``None`` when the dialect cannot merge."""
        events = batch.events
        frames = self._frames.frames(batch)
        merge = self._frames.merged_tokens
        parts: list[bytes] = []
        run: list[str] = []
        num_merged = 0
        first_seq = batch.first_seq
        for index in range(len(events) + 1):
            event = events[index] if index < len(events) else None
            if type(event) is TextDelta:
                run.append(event.text)
                continue
            if len(run) > 1:
                merged = merge("".join(run), first_seq + index - 1)
                if merged is None:
                    return None
                parts.append(merged)
                num_merged += len(run) - 1
            elif run:
                parts.append(frames[index - 1])  # a run of one keeps its frame
            run.clear()
            if event is not None:
                parts.append(frames[index])
        delivery = self.reader.delivery
        if num_merged and delivery is not None:
            delivery.coalesced_events(num_merged)
        return b"".join(parts)
