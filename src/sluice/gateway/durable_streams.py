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

import contextlib
import logging
from collections.abc import Sequence
from urllib.parse import parse_qs

import orjson

from sluice.errors import (
    DurableStreamError,
    InvalidParameterError,
    SluiceError,
    StreamNotFoundError,
)
from sluice.events import Payload
from sluice.gateway.auth import TOKEN_PARAM, Auth, Caller, presented_token
from sluice.gateway.cors import CorsPolicy
from sluice.gateway.durable_reads import DurableReads, ReadView, respond
from sluice.gateway.errors import AuthenticationError, PayloadTooLargeError, answer_for
from sluice.streams.durable import (
    Append,
    Config,
    DurableStream,
    DurableStreams,
    Fork,
)
from sluice.streams.hub import StreamHub
from sluice.streams.ids import is_stream_id
from sluice.transports.asgi import Receive, Scope, Send
from sluice.transports.durable import (
    NOW,
    DurableOptions,
    essence,
    format_offset,
    is_json,
    json_messages,
    parse_expires_at,
    parse_offset,
    parse_producer,
    parse_ttl,
    strict_int,
)

__all__ = ["PREFIX", "DurableStreamsApi"]

logger = logging.getLogger("sluice.gateway")

PREFIX = "/v1/ds"
_LLM_PREFIX = "/streams/"
_JSON = "application/json"
# A body over the limit is still read (and dropped) up to this much, so that its client
# gets the 413; past it the connection is dropped.
_MAX_DRAINED_BYTES = 64 * 1024 * 1024
# What a page of another origin may read of an answer (when CORS lets it call at all).
_EXPOSED = (
    b"Stream-Next-Offset, Stream-Up-To-Date, Stream-Closed, Stream-Cursor, Stream-TTL, "
    b"Stream-Expires-At, Stream-SSE-Data-Encoding, Producer-Epoch, Producer-Seq, "
    b"Producer-Expected-Seq, Producer-Received-Seq, ETag, Location, Retry-After"
)


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
        self._reads = DurableReads(hub, streams, options)

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
            await respond(send, answer.status, headers + extra, body)

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
            stream_id = path[len(_LLM_PREFIX) :]
            await self._hub.attach(stream_id)  # a stream another replica runs
            stream = self._auth.find(self._hub.get, stream_id, caller)
            if method not in ("GET", "HEAD"):
                allow = (("Allow", "GET, HEAD"),)
                raise DurableStreamError(
                    "an LLM stream is read-only", stream_id=stream.id, status=405, headers=allow
                )
            view = ReadView(stream.id, _JSON, llm=stream)
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
                self._streams.delete(stream_)
                await respond(send, 204, extra)
                return
            if method not in ("GET", "HEAD"):
                raise DurableStreamError(
                    f"method {method} is not served",
                    stream_id=path,
                    status=405,
                    headers=(("Allow", "GET, HEAD, PUT, POST, DELETE"),),
                )
            durable = self._streams.get(tenant, path, touch=method == "GET")
            view = ReadView(durable.log_id, durable.content_type, durable=durable)
        if method == "HEAD":
            await self._reads.head(send, extra, view)
        else:
            await self._reads.read(receive, send, extra, view, query, headers.get("if-none-match"))

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
            (b"stream-next-offset", format_offset(self._hub.log.last_seq(stream.log_id)).encode()),
        ]
        if stream.closed:
            answer.append((b"stream-closed", b"true"))
        if created:
            answer.append((b"location", _location(scope).encode("latin-1")))
        await respond(send, 201 if created else 200, answer + extra)

    async def _append(
        self,
        receive: Receive,
        send: Send,
        extra: list[tuple[bytes, bytes]],
        stream: DurableStream,
        headers: _Headers,
    ) -> None:
        close = _is_true(headers.get("stream-closed"))
        producer = parse_producer(
            headers.get("producer-id"), headers.get("producer-epoch"), headers.get("producer-seq")
        )
        body = await self._body(receive)
        records: list[Payload] = []
        if body:
            content_type = headers.get("content-type")
            if not content_type:
                raise InvalidParameterError("an append needs a Content-Type", "Content-Type")
            if not stream.closed and essence(content_type) != essence(stream.content_type):
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
        await respond(send, done.status, answer + extra)

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


def _location(scope: Scope) -> str:
    host = "127.0.0.1"
    for name, value in scope["headers"]:
        if name == b"host":
            host = value.decode("latin-1")
    scheme = scope.get("scheme", "http")
    return f"{scheme}://{host}{scope['path']}"
