"""``/v1/ds/``: the Durable Streams protocol (durable-streams/durable-streams, v1.0).

Two kinds of stream answer under the prefix, with one read path:

- ``/v1/ds/streams/{stream_id}``: an LLM stream of the hub, read-only, in JSON mode: one
  JSON message per native event, ``{"id": "<stream_id>:<n>", "event": "token", "data":
  {...}}``; it is closed once its terminal event is in the log. Who may read it is who may
  read its SSE (its tenant, or a holder of its resume token: ``?token=`` or the header).
- any other path: a durable stream the caller's tenant creates (``PUT``), appends to
  (``POST``), reads, closes and deletes (:mod:`sluice.streams.durable`); each tenant has
  its own paths.

Reads: catch-up (no ``live``), ``live=long-poll`` (held by
:func:`sluice.transports.longpoll.poll_once`, as ``/v1/streams/{id}/poll`` is) and
``live=sse``. Wire rules (offsets, frames, cursors) are :mod:`sluice.transports.durable`'s.
Raw ASGI: an SSE response streams, and its headers are the protocol's exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from urllib.parse import parse_qs

import orjson

from sluice.errors import (
    DurableStreamError,
    InvalidParameterError,
    ResumeGapError,
    SluiceError,
    StreamNotFoundError,
)
from sluice.events import NeutralEvent, Payload, is_terminal
from sluice.gateway.auth import TOKEN_PARAM, Auth, Caller, presented_token
from sluice.gateway.cors import CorsPolicy
from sluice.gateway.errors import AuthenticationError, PayloadTooLargeError, answer_for
from sluice.streams.durable import (
    Append,
    Config,
    DurableStream,
    DurableStreams,
    Fork,
    ProducerRequest,
)
from sluice.streams.hub import Stream, StreamHub
from sluice.streams.ids import is_stream_id, parse_position
from sluice.streams.log import Batch
from sluice.streams.reader import Reader
from sluice.transports.asgi import Receive, Scope, Send
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
    json_messages,
    parse_expires_at,
    parse_offset,
    parse_producer,
    parse_ttl,
    read_body,
    strict_int,
)
from sluice.transports.longpoll import MAX_POLL_EVENTS, poll_once
from sluice.transports.native_json import native_message

__all__ = ["PREFIX", "DurableStreamsApi"]

logger = logging.getLogger("sluice.gateway")

PREFIX = "/v1/ds"
_LLM_PREFIX = "/streams/"
_JSON = "application/json"
_COMMON = [
    (b"x-content-type-options", b"nosniff"),
    (b"cross-origin-resource-policy", b"cross-origin"),
]
# A body over the limit is still read (and dropped) up to this much, so that its client
# gets the 413; past it the connection is dropped.
_MAX_DRAINED_BYTES = 64 * 1024 * 1024
# What a page of another origin may read of an answer (when CORS lets it call at all).
_EXPOSED = (
    b"Stream-Next-Offset, Stream-Up-To-Date, Stream-Closed, Stream-Cursor, Stream-TTL, "
    b"Stream-Expires-At, Stream-SSE-Data-Encoding, Producer-Epoch, Producer-Seq, "
    b"Producer-Expected-Seq, Producer-Received-Seq, ETag, Location, Retry-After"
)
# Catch-up chunks short of the tail never change (section 10.1); a read that reached the
# tail is revalidated (its ETag answers 304 while nothing was appended).
_IMMUTABLE_CHUNK = "private, max-age=60, stale-while-revalidate=300"
_AT_TAIL = "no-cache"


class _View:
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


class DurableStreamsApi:
    """The ASGI app of everything under :data:`PREFIX`."""

    def __init__(
        self,
        hub: StreamHub,
        streams: DurableStreams,
        auth: Auth,
        cors: CorsPolicy,
        options: DurableOptions,
        max_body_bytes: int,
    ) -> None:
        self._hub = hub
        self._streams = streams
        self._auth = auth
        self._cors = cors
        self._options = options
        self._max_body_bytes = max_body_bytes

    @staticmethod
    def serves_path(path: str) -> bool:
        return path == PREFIX or path.startswith(PREFIX + "/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extra = [
            (name, _EXPOSED if name == b"access-control-expose-headers" else value)
            for name, value in self._cors.response_headers(scope["headers"])
        ]
        try:
            await self._serve(scope, receive, send, extra)
        except SluiceError as exc:
            answer = answer_for(exc)
            headers = [(name.encode(), value.encode()) for name, value in answer.headers.items()]
            body = b""
            if scope["method"] != "HEAD":
                error = {"error": {"code": answer.code, "message": answer.message}}
                body = orjson.dumps(error)
                headers.append((b"content-type", _JSON.encode()))
            await _respond(send, answer.status, headers + extra, body)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, extra: list[tuple[bytes, bytes]]
    ) -> None:
        path = scope["path"][len(PREFIX) :]
        headers = _Headers(scope["headers"])
        query = parse_qs(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        method = scope["method"]
        token = query.get(TOKEN_PARAM)
        caller = self._auth.caller(
            scope["headers"], presented_token(scope["headers"], token[-1] if token else None)
        )
        if path.startswith(_LLM_PREFIX) and is_stream_id(path[len(_LLM_PREFIX) :]):
            stream = self._auth.find(self._hub.get, path[len(_LLM_PREFIX) :], caller)
            if method not in ("GET", "HEAD"):
                allow = (("Allow", "GET, HEAD"),)
                raise DurableStreamError(
                    "an LLM stream is read-only", stream_id=stream.id, status=405, headers=allow
                )
            view = _View(stream.id, _JSON, llm=stream)
        else:
            if not path or path == "/":
                raise StreamNotFoundError(path)
            tenant = _tenant(caller)
            if method == "PUT":
                await self._create(scope, receive, send, extra, tenant, path, headers)
                return
            if method == "POST":
                stream_ = self._streams.get(tenant, path)
                await self._append(receive, send, extra, stream_, headers)
                return
            if method == "DELETE":
                stream_ = self._streams.get(tenant, path, touch=False)
                await self._streams.delete(stream_)
                await _respond(send, 204, extra)
                return
            if method not in ("GET", "HEAD"):
                raise DurableStreamError(
                    f"method {method} is not served",
                    stream_id=path,
                    status=405,
                    headers=(("Allow", "GET, HEAD, PUT, POST, DELETE"),),
                )
            durable = self._streams.get(tenant, path, touch=method == "GET")
            view = _View(durable.log_id, durable.content_type, durable=durable)
        if method == "HEAD":
            await self._head(send, extra, view)
        else:
            await self._read(scope, receive, send, extra, view, query, headers)

    # -- write side -------------------------------------------------------------------------

    async def _create(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        tenant: str,
        path: str,
        headers: _Headers,
    ) -> None:
        ttl = headers.get("stream-ttl")
        expires = headers.get("stream-expires-at")
        if ttl is not None and expires is not None:
            raise InvalidParameterError(
                "give Stream-TTL or Stream-Expires-At, not both", "Stream-TTL"
            )
        source = headers.get("stream-forked-from")
        sub = headers.get("stream-fork-sub-offset")
        fork_offset = headers.get("stream-fork-offset")
        if source is None and (sub is not None or fork_offset is not None):
            raise InvalidParameterError(
                "Stream-Fork-Offset and Stream-Fork-Sub-Offset need Stream-Forked-From",
                "Stream-Forked-From",
            )
        fork = None
        if source is not None:
            if source.startswith(PREFIX + "/"):
                source = source[len(PREFIX) :]
            offset = None
            if fork_offset is not None:
                offset = parse_offset(fork_offset)
                if offset == NOW:
                    raise InvalidParameterError("Stream-Fork-Offset: not an offset", "offset")
            fork = Fork(
                source, offset, 0 if sub is None else strict_int(sub, "Stream-Fork-Sub-Offset")
            )
        content_type = headers.get("content-type")
        config = Config(
            content_type=content_type or None,
            ttl_s=None if ttl is None else parse_ttl(ttl),
            expires_at=None if expires is None else parse_expires_at(expires),
            closed=_is_true(headers.get("stream-closed")),
            fork=fork,
        )
        body = await self._body(receive)
        json_mode = is_json(content_type or "")
        if fork is not None and not content_type:
            with contextlib.suppress(SluiceError):
                json_mode = is_json(
                    self._streams.get(tenant, fork.source, touch=False).content_type
                )
        records = _records(body, json_mode, allow_empty_array=True) if body else []
        stream, created = await self._streams.create(tenant, path, config, records, json_mode)
        answer = [
            (b"content-type", stream.content_type.encode("latin-1")),
            (b"stream-next-offset", format_offset(self._tail(stream.log_id)).encode()),
        ]
        if stream.closed:
            answer.append((b"stream-closed", b"true"))
        if created:
            answer.append((b"location", _location(scope).encode("latin-1")))
        await _respond(send, 201 if created else 200, answer + extra)

    async def _append(
        self,
        receive: Receive,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        stream: DurableStream,
        headers: _Headers,
    ) -> None:
        close = _is_true(headers.get("stream-closed"))
        parsed = parse_producer(
            headers.get("producer-id"), headers.get("producer-epoch"), headers.get("producer-seq")
        )
        producer = None if parsed is None else ProducerRequest(parsed.id, parsed.epoch, parsed.seq)
        body = await self._body(receive)
        records: list[Payload] = []
        if body:
            content_type = headers.get("content-type")
            if not content_type:
                raise InvalidParameterError("an append needs a Content-Type", "Content-Type")
            if not stream.closed and _media(content_type) != _media(stream.content_type):
                raise DurableStreamError(
                    f"the stream's content type is {stream.content_type}",
                    stream_id=stream.path,
                    status=409,
                )
            records = _records(body, is_json(stream.content_type), allow_empty_array=False)
        elif not close:
            raise InvalidParameterError("an append needs a body (or Stream-Closed: true)", "body")
        request = Append(records, close, producer, headers.get("stream-seq"))
        done = await self._streams.append(stream, request)
        answer = [(b"stream-next-offset", format_offset(done.next_seq).encode())]
        if done.closed:
            answer.append((b"stream-closed", b"true"))
        if producer is not None and done.producer is not None:
            answer.append((b"producer-epoch", str(done.producer[0]).encode()))
            answer.append((b"producer-seq", str(done.producer[1]).encode()))
        await _respond(send, done.status, answer + extra)

    async def _body(self, receive: Receive) -> bytes:
        parts: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            part = message.get("body", b"")
            size += len(part)
            more = message.get("more_body", False)
            if size <= self._max_body_bytes:
                parts.append(part)
            elif not more or size > _MAX_DRAINED_BYTES:
                # Read to the end first: a client still sending when the answer comes back
                # sees a reset connection instead of the 413.
                raise PayloadTooLargeError(f"a body holds at most {self._max_body_bytes} bytes")
        return b"".join(parts)

    # -- read side --------------------------------------------------------------------------

    def _tail(self, log_id: str) -> int:
        return self._hub.log.last_seq(log_id)

    def _closed_at(self, view: _View, seq: int) -> bool:
        """Whether ``seq`` is the end of a closed stream (EOF)."""
        tail = self._tail(view.log_id)
        if seq < tail:
            return False
        if view.durable is not None:
            return view.durable.closed
        if tail == 0:
            return False
        with contextlib.suppress(ResumeGapError):
            last = self._hub.log.read(view.log_id, tail - 1, 1)
            return bool(last.events) and is_terminal(last.events[-1])
        return True

    async def _head(self, send: Send, extra: list[tuple[bytes, bytes]], view: _View) -> None:
        tail = self._tail(view.log_id)
        answer = [
            (b"content-type", view.content_type.encode("latin-1")),
            (b"stream-next-offset", format_offset(tail).encode()),
            (b"cache-control", b"no-store"),
        ]
        if self._closed_at(view, tail):
            answer.append((b"stream-closed", b"true"))
        durable = view.durable
        if durable is not None and durable.ttl_s is not None:
            answer.append((b"stream-ttl", str(durable.ttl_s).encode()))
        if durable is not None and durable.expires_at is not None:
            answer.append((b"stream-expires-at", _rfc3339(durable.expires_at).encode()))
        await _respond(send, 200, answer + extra)

    def _position(self, view: _View, query: dict[str, list[str]], *, required: bool) -> int:
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

    def _batch(self, view: _View, after: int, max_records: int = MAX_POLL_EVENTS) -> Batch:
        batch = self._hub.log.read(view.log_id, after, max_records)
        if view.durable is None or len(batch.events) <= 1:
            return batch
        total = 0
        for count, event in enumerate(batch.events):
            total += len(event.data) if isinstance(event, Payload) else 0
            if total > self._options.max_read_bytes and count:
                return Batch(batch.first_seq, batch.events[:count])
        return batch

    def _encode(self, view: _View, batch: Batch) -> bytes:
        if view.llm is None:
            data = [event.data for event in batch.events if isinstance(event, Payload)]
            return read_body(data, is_json(view.content_type))
        return _llm_body(view.llm.id, batch.first_seq, batch.events)

    def _reader(self, view: _View, after: int) -> Reader:
        if view.durable is not None:
            return self._streams.open_reader(view.durable, after)
        return self._hub.open_reader(view.log_id, after)

    async def _read(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        view: _View,
        query: dict[str, list[str]],
        headers: _Headers,
    ) -> None:
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
            await _respond(send, 200, answer + extra, body)
            return
        batch = self._batch(view, after)
        next_seq = batch.last_seq if batch.events else after
        tail = self._tail(view.log_id)
        etag = (
            f'"{view.log_id}:{after}:{next_seq}{":c" if self._closed_at(view, next_seq) else ""}"'
        )
        cache = _AT_TAIL if next_seq >= tail else _IMMUTABLE_CHUNK
        answer = self._read_headers(view, after, next_seq, cache=cache.encode())
        answer.append((b"etag", etag.encode()))
        if headers.get("if-none-match") == etag:
            await _respond(send, 304, answer + extra)
            return
        await _respond(send, 200, answer + extra, self._encode(view, batch))

    def _read_headers(
        self, view: _View, after: int, next_seq: int, *, cache: bytes
    ) -> list[tuple[bytes, bytes]]:
        answer = [
            (b"content-type", view.content_type.encode("latin-1")),
            (b"stream-next-offset", format_offset(next_seq).encode()),
            (b"cache-control", cache),
        ]
        if next_seq >= self._tail(view.log_id):
            answer.append((b"stream-up-to-date", b"true"))
        if self._closed_at(view, next_seq):
            answer.append((b"stream-closed", b"true"))
        return answer

    async def _long_poll(
        self,
        receive: Receive,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        view: _View,
        after: int,
        cursor: str | None,
    ) -> None:
        batch = Batch(after + 1, ())
        if not self._closed_at(view, after):
            reader = self._reader(view, after)
            batch = await poll_once(reader, receive, self._options.long_poll_s)
            batch = self._trimmed(view, batch)
        next_seq = batch.last_seq if batch.events else after
        answer = self._read_headers(view, after, next_seq, cache=b"no-store")
        if not self._closed_at(view, next_seq):
            answer.append((b"stream-cursor", cursor_after(cursor).encode()))
        if not batch.events:
            await _respond(send, 204, answer + extra)
            return
        await _respond(send, 200, answer + extra, self._encode(view, batch))

    def _trimmed(self, view: _View, batch: Batch) -> Batch:
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
        view: _View,
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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._options.sse_connection_s
        try:
            await send(
                {"type": "http.response.start", "status": 200, "headers": _COMMON + headers + extra}
            )
            async with watching_disconnect(receive, left):
                sent_control = False
                while not gone and not reader.interrupted:  # dropped: the client resumes
                    batch = self._batch(view, reader.after_seq)
                    if batch.events:
                        reader.after_seq = batch.last_seq
                        next_seq = batch.last_seq
                        closed = self._closed_at(view, next_seq)
                        frames = data_frame(self._encode(view, batch), view.content_type)
                        frames += control_frame(
                            format_offset(next_seq),
                            cursor=cursor,
                            up_to_date=next_seq >= self._tail(view.log_id),
                            closed=closed,
                        )
                        await _write(send, frames)
                        sent_control = True
                        if closed:
                            break
                        continue
                    position = reader.after_seq
                    if self._closed_at(view, position) or (
                        view.durable is not None and view.durable.gone
                    ):
                        await _write(
                            send,
                            control_frame(
                                format_offset(position), cursor=None, up_to_date=True, closed=True
                            ),
                        )
                        break
                    if not sent_control:
                        await _write(
                            send,
                            control_frame(
                                format_offset(position),
                                cursor=cursor,
                                up_to_date=True,
                                closed=False,
                            ),
                        )
                        sent_control = True
                    left_s = deadline - loop.time()
                    if left_s <= 0 or not await reader.wait(left_s):
                        break  # long enough (section 10.2): the client reconnects
            await send({"type": "http.response.body", "body": b""})
        except (OSError, ResumeGapError):
            pass  # the client left mid-write, or the log dropped the position: it resumes
        finally:
            reader.close()


# -- helpers ----------------------------------------------------------------------------------


class _Headers:
    """A request's headers by lower-case name (the last value of a repeated one)."""

    __slots__ = ("_values",)

    def __init__(self, raw: Sequence[tuple[bytes, bytes]]) -> None:
        self._values = {
            name.decode("latin-1").lower(): value.decode("latin-1") for name, value in raw
        }

    def get(self, name: str) -> str | None:
        return self._values.get(name)


def _tenant(caller: Caller) -> str:
    if caller.tenant is None:
        raise AuthenticationError("a durable stream needs an API key (a resume token reads only)")
    return caller.tenant


def _is_true(value: str | None) -> bool:
    """``Stream-Closed`` counts only as ``true``, in any case (section 4.1)."""
    return value is not None and value.strip().lower() == "true"


def _media(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _records(body: bytes, json_mode: bool, *, allow_empty_array: bool) -> list[Payload]:
    """The records of an append's (or a creation's) body: one per request."""
    if not json_mode:
        return [Payload(body)]
    try:
        messages = json_messages(body)
    except (ValueError, RecursionError) as exc:
        raise InvalidParameterError(f"body: not JSON: {exc}", "body") from exc
    if not messages:
        if allow_empty_array:
            return []
        raise InvalidParameterError("body: an empty JSON array appends nothing", "body")
    return [Payload(b",".join(messages), len(messages))]


def _llm_body(stream_id: str, first_seq: int, events: Sequence[NeutralEvent]) -> bytes:
    """An LLM stream's events as one JSON array of native messages."""
    parts = []
    for offset, event in enumerate(events):
        name, data = native_message(event)
        parts.append(f'{{"id":"{stream_id}:{first_seq + offset}","event":"{name}","data":{data}}}')
    return f"[{','.join(parts)}]".encode()


def _location(scope: Scope) -> str:
    host = "127.0.0.1"
    for name, value in scope["headers"]:
        if name == b"host":
            host = value.decode("latin-1")
    scheme = scope.get("scheme", "http")
    return f"{scheme}://{host}{scope['path']}"


def _rfc3339(unix_s: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat().replace("+00:00", "Z")


async def _respond(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> None:
    all_headers = _COMMON + headers
    if status not in (204, 304):
        all_headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body if status not in (204, 304) else b""})


async def _write(send: Send, frames: bytes) -> None:
    await send({"type": "http.response.body", "body": frames, "more_body": True})
