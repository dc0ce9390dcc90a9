"""Long-poll: a stream's events as JSON batches, one ``GET`` at a time.

``GET /v1/streams/{id}/poll?after=<stream_id>:<n>&timeout_s=S`` answers at once with the
retained events after the cursor, or holds until one arrives or ``timeout_s`` passes:

    {"events": [{"id": "<stream_id>:<n>", "event": "token", "data": {...}}, ...],
     "next": "<stream_id>:<m>", "done": false}

``next`` is the cursor of the next poll (the id of the last event given, or ``after``
when none came); ``done`` is true once the terminal event is among those given. Events are
the native dialect's (:mod:`sluice.transports.native_json`), with the ids every transport
uses, so a client may switch between SSE, WebSocket and long-poll with the same cursor.

This module holds the query's rules, the answer's encoding (sans-IO) and the hold: read,
else wait once for the log (:meth:`~sluice.streams.reader.Reader.wait`), then read, while
watching for the client leaving (:func:`poll_once`). The gateway
(:mod:`sluice.gateway.longpoll`) decides who may poll what. The Durable Streams long-poll
(``live=long-poll``, :mod:`sluice.gateway.durable_streams`) holds its requests with the same
:func:`poll_once`.

Deliberate choices:

1. ``after`` is an event id, never a frame id ``<n>.<k>``: a poll renders natively, one
   message per event, so "part of an event" names nothing here (``400``).
2. An answer holds at most :data:`MAX_POLL_EVENTS` events; a client behind by more gets
   the oldest ones and polls again from ``next`` at once.
3. No heartbeats: an answer is one JSON document. The default hold (25 s) stays below the
   30-60 s idle timeouts of common proxies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import orjson

from sluice.errors import BadEventIdError, InvalidParameterError
from sluice.streams.ids import parse_position
from sluice.streams.log import Batch
from sluice.streams.reader import Reader
from sluice.transports.asgi import Receive
from sluice.transports.disconnect import watching_disconnect
from sluice.transports.native_json import native_message

__all__ = [
    "DEFAULT_POLL_TIMEOUT_S",
    "MAX_POLL_EVENTS",
    "MAX_POLL_TIMEOUT_S",
    "PollQuery",
    "encode_poll",
    "hold",
    "parse_poll_query",
    "poll_once",
]

# Below the 30-60 s idle timeouts of common proxies and load balancers.
DEFAULT_POLL_TIMEOUT_S = 25.0
# A poll is a held request: bounded, so a proxy or a forgotten client does not hold one
# for longer than a minute.
MAX_POLL_TIMEOUT_S = 60.0
# The most events in one answer (the delivery core's batch bound): a few tens of KiB of
# tokens, so a client that is far behind catches up in a few polls, none huge.
MAX_POLL_EVENTS = 512


@dataclass(frozen=True, slots=True)
class PollQuery:
    """A poll's query: the events after ``after_seq``, held for at most ``timeout_s``."""

    after_seq: int
    timeout_s: float


def parse_poll_query(query: Mapping[str, Sequence[str]], stream_id: str) -> PollQuery:
    """The query of a poll of ``stream_id``; raises :class:`InvalidParameterError` naming
    the parameter (``after``, ``timeout_s``) for a bad value. No ``after``: from the start."""
    after_seq = 0
    values = query.get("after")
    if values and values[-1]:
        try:
            position_stream, after_seq, num_frames = parse_position(values[-1])
        except BadEventIdError as exc:
            raise InvalidParameterError(f"after: {exc}", "after") from exc
        if num_frames:
            raise InvalidParameterError(
                f"after: {values[-1]!r} is a frame id; poll from an event id "
                "'<stream id>:<event number>'",
                "after",
            )
        if position_stream != stream_id:
            raise InvalidParameterError(
                f"after: the cursor belongs to stream {position_stream}, not {stream_id}",
                "after",
            )
    timeout_s = DEFAULT_POLL_TIMEOUT_S
    values = query.get("timeout_s")
    if values and values[-1]:
        try:
            timeout_s = float(values[-1])
        except ValueError:
            raise InvalidParameterError(
                f"timeout_s: not a number: {values[-1][:40]!r}", "timeout_s"
            ) from None
        if not 0 <= timeout_s <= MAX_POLL_TIMEOUT_S:  # also refuses NaN
            raise InvalidParameterError(
                f"timeout_s: must be between 0 and {MAX_POLL_TIMEOUT_S:g}", "timeout_s"
            )
    return PollQuery(after_seq, timeout_s)


async def hold(reader: Reader, timeout_s: float, max_events: int = MAX_POLL_EVENTS) -> Batch:
    """The events after the reader's position: those retained now, else the first to
    arrive within ``timeout_s`` (an empty batch when none did, or the reader was woken
    for another reason: its client left, the server drops it). Raises what
    :meth:`~sluice.streams.reader.Reader.read` raises."""
    batch = reader.read(max_events)
    if batch.events or reader.done or timeout_s <= 0:
        return batch
    if not reader.interrupted:
        await reader.wait(timeout_s)
    if reader.interrupted:
        # The server asked the reader to go: its client polls again from the same cursor
        # (the log may be gone meanwhile: a replica that lost Redis drops its mirror).
        return batch
    return reader.read(max_events)


async def poll_once(
    reader: Reader, receive: Receive, timeout_s: float, max_events: int = MAX_POLL_EVENTS
) -> Batch:
    """One long-poll: :func:`hold` while watching the client (one that leaves wakes the
    reader, and gets an empty batch), then close the reader. Every long-poll of the server
    (``/poll`` and Durable Streams' ``live=long-poll``) is held here."""
    try:
        async with watching_disconnect(receive, reader.wake):
            return await hold(reader, timeout_s, max_events)
    finally:
        reader.close()


def encode_poll(stream_id: str, batch: Batch, *, after_seq: int, done: bool) -> bytes:
    """The JSON answer of a poll that got ``batch`` (read after ``after_seq``)."""
    prefix = f'{{"id":"{stream_id}:'
    parts = []
    seq = batch.first_seq
    for event in batch.events:
        name, data = native_message(event)
        parts.append(f'{prefix}{seq}","event":"{name}","data":{data}}}')
        seq += 1
    next_seq = batch.last_seq if batch.events else after_seq
    tail = orjson.dumps({"next": f"{stream_id}:{next_seq}", "done": done}).decode()
    return f'{{"events":[{",".join(parts)}],{tail[1:]}'.encode()
