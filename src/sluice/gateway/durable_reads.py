"""The read side of ``/v1/ds/`` (:mod:`sluice.gateway.durable_streams`): ``HEAD``, catch-up
reads, ``live=long-poll`` and ``live=sse``, for both kinds of stream (an LLM stream of the
hub, a client's durable stream) through one :class:`ReadView`.

A long-poll is held by :func:`sluice.transports.longpoll.poll_once`, the hold of
``/v1/streams/{id}/poll`` too. An SSE response follows the log with one reader until the
stream closes, the client leaves, the server drops the reader (the client resumes from the
last ``streamNextOffset``) or ``sse_connection_s`` passes (section 10.2).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Callable, Sequence

from sluice.errors import InvalidParameterError, ResumeGapError, StreamNotFoundError
from sluice.events import NeutralEvent, Payload, is_terminal
from sluice.streams.durable import DurableStream, DurableStreams
from sluice.streams.hub import Stream, StreamHub
from sluice.streams.ids import parse_position
from sluice.streams.log import Batch
from sluice.streams.reader import Reader
from sluice.transports.asgi import Receive, Send
from sluice.transports.disconnect import watching_disconnect
from sluice.transports.durable import (
    NOW,
    DurableOptions,
    control_frame,
    cursor_after,
    data_frame,
    format_offset,
    is_json,
    is_text,
    parse_offset,
    read_body,
)
from sluice.transports.longpoll import MAX_POLL_EVENTS, poll_once
from sluice.transports.native_json import native_message

__all__ = ["COMMON_HEADERS", "DurableReads", "ReadView", "respond"]

# On every answer under /v1/ds/ (sections 12.7: browser security headers).
COMMON_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"cross-origin-resource-policy", b"cross-origin"),
]
# Catch-up chunks short of the tail never change (section 10.1); a read that reached the
# tail is revalidated (its ETag answers 304 while nothing was appended).
_IMMUTABLE_CHUNK = "private, max-age=60, stale-while-revalidate=300"
_AT_TAIL = "no-cache"


class ReadView:
    """What a read needs of either kind of stream."""

    __slots__ = ("content_type", "durable", "llm", "log_id")

    def __init__(
        self,
        log_id: str,
        content_type: str,
        durable: DurableStream | None = None,
        llm: Stream | None = None,
    ) -> None:
        self.log_id = log_id
        self.content_type = content_type
        self.durable = durable
        self.llm = llm


class DurableReads:
    """Reads of one hub's streams under ``/v1/ds/``."""

    def __init__(self, hub: StreamHub, streams: DurableStreams, options: DurableOptions) -> None:
        self._hub = hub
        self._streams = streams
        self._options = options

    def _tail(self, log_id: str) -> int:
        return self._hub.log.last_seq(log_id)

    def closed_at(self, view: ReadView, seq: int) -> bool:
        """Whether ``seq`` is the end of a closed stream (EOF)."""
        tail = self._tail(view.log_id)
        if seq < tail:
            return False
        if view.durable is not None:
            return view.durable.closed
        if tail == 0:
            return False
        with contextlib.suppress(ResumeGapError):  # the newest record is never trimmed
            last = self._hub.log.read(view.log_id, tail - 1, 1)
            return bool(last.events) and is_terminal(last.events[-1])
        return False

    async def head(self, send: Send, extra: list[tuple[bytes, bytes]], view: ReadView) -> None:
        tail = self._tail(view.log_id)
        answer = [
            (b"content-type", view.content_type.encode("latin-1")),
            (b"stream-next-offset", format_offset(tail).encode()),
            (b"cache-control", b"no-store"),
        ]
        if self.closed_at(view, tail):
            answer.append((b"stream-closed", b"true"))
        durable = view.durable
        if durable is not None and durable.ttl_s is not None:
            answer.append((b"stream-ttl", str(durable.ttl_s).encode()))
        if durable is not None and durable.expires_at is not None:
            answer.append((b"stream-expires-at", _rfc3339(durable.expires_at).encode()))
        await respond(send, 200, answer + extra)

    def _position(self, view: ReadView, query: dict[str, list[str]], *, required: bool) -> int:
        values = query.get("offset")
        if values is None:
            if required:
                raise InvalidParameterError("offset: required for live reads", "offset")
            return 0
        if len(values) != 1 or not values[0]:
            raise InvalidParameterError("offset: give exactly one offset", "offset")
        text = values[0]
        if view.llm is not None and ":" in text:
            stream_id, seq, frames = parse_position(text)  # an event id of the stream
            if stream_id != view.llm.id or frames:
                raise InvalidParameterError("offset: not an event id of this stream", "offset")
        else:
            seq = parse_offset(text)
        tail = self._tail(view.log_id)
        if seq == NOW:
            return tail
        if seq > tail:
            raise InvalidParameterError(f"offset: past the stream's tail (event {tail})", "offset")
        return seq

    def _batch(self, view: ReadView, after: int, max_records: int = MAX_POLL_EVENTS) -> Batch:
        batch = self._hub.log.read(view.log_id, after, max_records)
        if view.durable is None or len(batch.events) <= 1:
            return batch
        total = 0
        for count, event in enumerate(batch.events):
            total += len(event.data) if isinstance(event, Payload) else 0
            if total > self._options.max_read_bytes and count:
                return Batch(batch.first_seq, batch.events[:count])
        return batch

    def _encode(self, view: ReadView, batch: Batch) -> bytes:
        if view.llm is None:
            data = [event.data for event in batch.events if isinstance(event, Payload)]
            return read_body(data, is_json(view.content_type))
        return _llm_body(view.llm.id, batch.first_seq, batch.events)

    def _reader(self, view: ReadView, after: int) -> Reader:
        if view.durable is not None:
            return self._streams.open_reader(view.durable, after)
        return self._hub.open_reader(view.log_id, after)

    async def read(
        self,
        receive: Receive,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        view: ReadView,
        query: dict[str, list[str]],
        if_none_match: str | None,
    ) -> None:
        """A ``GET``: catch-up, ``live=long-poll`` or ``live=sse`` (sections 5.6-5.8)."""
        live = query.get("live", [""])[-1]
        if live not in ("", "long-poll", "sse"):
            raise InvalidParameterError(f"live: unknown mode {live[:20]!r}", "live")
        now = query.get("offset") == ["now"]
        after = self._position(view, query, required=bool(live))
        cursor = query.get("cursor", [None])[-1]
        if live == "sse":
            await self._sse(receive, send, extra, view, after, cursor)
            return
        if live == "long-poll":
            await self._long_poll(receive, send, extra, view, after, cursor)
            return
        if now:
            body = b"[]" if is_json(view.content_type) else b""
            answer = self._read_headers(view, after, after, cache=b"no-store")
            await respond(send, 200, answer + extra, body)
            return
        batch = self._batch(view, after)
        next_seq = batch.last_seq if batch.events else after
        tail = self._tail(view.log_id)
        etag = f'"{view.log_id}:{after}:{next_seq}{":c" if self.closed_at(view, next_seq) else ""}"'
        cache = _AT_TAIL if next_seq >= tail else _IMMUTABLE_CHUNK
        answer = self._read_headers(view, after, next_seq, cache=cache.encode())
        answer.append((b"etag", etag.encode()))
        if if_none_match == etag:
            await respond(send, 304, answer + extra)
            return
        await respond(send, 200, answer + extra, self._encode(view, batch))

    def _read_headers(
        self, view: ReadView, after: int, next_seq: int, *, cache: bytes
    ) -> list[tuple[bytes, bytes]]:
        answer = [
            (b"content-type", view.content_type.encode("latin-1")),
            (b"stream-next-offset", format_offset(next_seq).encode()),
            (b"cache-control", cache),
        ]
        if next_seq >= self._tail(view.log_id):
            answer.append((b"stream-up-to-date", b"true"))
        if self.closed_at(view, next_seq):
            answer.append((b"stream-closed", b"true"))
        return answer

    async def _long_poll(
        self,
        receive: Receive,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        view: ReadView,
        after: int,
        cursor: str | None,
    ) -> None:
        batch = Batch(after + 1, ())
        if not self.closed_at(view, after):
            reader = self._reader(view, after)
            batch = await poll_once(reader, receive, self._options.long_poll_s)
            batch = self._trimmed(view, batch)
        next_seq = batch.last_seq if batch.events else after
        answer = self._read_headers(view, after, next_seq, cache=b"no-store")
        if not self.closed_at(view, next_seq):
            answer.append((b"stream-cursor", cursor_after(cursor).encode()))
        if not batch.events:
            await respond(send, 204, answer + extra)
            return
        await respond(send, 200, answer + extra, self._encode(view, batch))

    def _trimmed(self, view: ReadView, batch: Batch) -> Batch:
        """A held batch cut to the read's byte bound, as a catch-up read would be."""
        if not batch.events:
            return batch
        cut = self._batch(view, batch.first_seq - 1, len(batch.events))
        return cut if cut.events else batch

    async def _sse(
        self,
        receive: Receive,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        view: ReadView,
        after: int,
        client_cursor: str | None,
    ) -> None:
        reader = self._reader(view, after)
        gone = False

        def left() -> None:
            nonlocal gone
            gone = True
            reader.wake()

        headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        if not is_text(view.content_type):
            headers.append((b"stream-sse-data-encoding", b"base64"))
        cursor = cursor_after(client_cursor)
        deadline = asyncio.get_running_loop().time() + self._options.sse_connection_s
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": COMMON_HEADERS + headers + extra,
                }
            )
            async with watching_disconnect(receive, left):
                await self._follow(send, view, reader, cursor, deadline, lambda: gone)
            await send({"type": "http.response.body", "body": b""})
        except OSError:
            pass  # the client left mid-write
        finally:
            reader.close()

    async def _follow(
        self,
        send: Send,
        view: ReadView,
        reader: Reader,
        cursor: str,
        deadline: float,
        client_gone: Callable[[], bool],
    ) -> None:
        """Write the SSE events of ``reader``'s records until the stream closes (the last
        control event says so), the client leaves, the server drops the reader, the stream
        is deleted, its log no longer holds the position, or ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        durable = view.durable
        sent_control = False
        while not client_gone() and not reader.interrupted:
            if durable is not None and (durable.gone or durable.deleted):
                return  # its reconnect gets the 404 or 410
            try:
                batch = self._batch(view, reader.after_seq)
            except (ResumeGapError, StreamNotFoundError):
                return  # its reconnect gets the 410 or 404
            position = batch.last_seq if batch.events else reader.after_seq
            reader.after_seq = position
            closed = self.closed_at(view, position)
            if batch.events or closed or not sent_control:
                frames = b""
                if batch.events:
                    frames = data_frame(self._encode(view, batch), view.content_type)
                frames += control_frame(
                    format_offset(position),
                    cursor=cursor,
                    up_to_date=position >= self._tail(view.log_id),
                    closed=closed,
                )
                await _write(send, frames)
                sent_control = True
                if closed:
                    return
                if batch.events:
                    continue
            left_s = deadline - loop.time()
            if left_s <= 0 or not await reader.wait(left_s):
                return  # long enough (section 10.2): the client reconnects


def _llm_body(stream_id: str, first_seq: int, events: Sequence[NeutralEvent]) -> bytes:
    """An LLM stream's events as one JSON array of native messages."""
    parts = []
    for offset, event in enumerate(events):
        name, data = native_message(event)
        parts.append(f'{{"id":"{stream_id}:{first_seq + offset}","event":"{name}","data":{data}}}')
    return f"[{','.join(parts)}]".encode()


def _rfc3339(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat().replace("+00:00", "Z")


async def respond(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> None:
    all_headers = COMMON_HEADERS + headers
    if status not in (204, 304):
        all_headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body if status not in (204, 304) else b""})


async def _write(send: Send, frames: bytes) -> None:
    await send({"type": "http.response.body", "body": frames, "more_body": True})
