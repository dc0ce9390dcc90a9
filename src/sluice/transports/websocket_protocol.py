"""The native WebSocket protocol of ``GET /v1/ws``, sans-IO: text in, messages out;
messages in, bytes out. No socket, no event loop (the shell is
:mod:`sluice.transports.websocket`).

Every WebSocket message is one JSON object in one text frame (RFC 6455 section 5.6).

Client to server:

=============  ==============================================================================
``create``     ``{"type": "create", "request": {...}}``: the body of ``POST /v1/streams``; the
               socket is subscribed to the new stream from its first event
``subscribe``  ``{"type": "subscribe", "stream_id": "...", "last_event_id": "<id>:<n>"|null}``:
               the events after ``last_event_id`` (null: all), then live ones
``cancel``     ``{"type": "cancel", "stream_id": "..."}``: as ``POST /v1/streams/{id}/cancel``
=============  ==============================================================================

Server to client:

=============  ==============================================================================
``created``    ``{"type": "created", "stream": {...}}``: the ``201`` body of ``POST /v1/streams``
``event``      ``{"type": "event", "stream_id", "id": "<stream_id>:<n>", "event", "data"}``: a
               native event (``start``, ``token``, ``tool_call``, ``usage``, ``done``, ``error``)
``error``      ``{"type": "error", "code", "message", "stream_id"?}``: a refused message, or a
               subscription ended without its terminal event; the socket stays open
=============  ==============================================================================

Deliberate choices, numbered as the SSE codec's are:

1. One JSON object per message, never several: a browser's ``onmessage`` gets one event.
2. Binary frames, messages that are not a JSON object, unknown types and missing or
   wrong-typed fields are refused with an ``error`` frame (``invalid_request``), not a
   close: a client bug costs one message, not every stream on the socket.
3. Event ids and data are the native ones (:mod:`sluice.transports.native_json`), whatever
   API created the stream, so the cursor of any transport resumes on this one.
4. No heartbeat messages: the WebSocket ping (RFC 6455 section 5.5.2), sent by the
   server, keeps proxies from closing an idle socket and detects a dead peer.
5. A ``resume_gap`` (the cursor is older than the retained log) is an ``error`` frame with
   the stream id, not an ``event``: it is not in the stream's log.
6. A subscription encodes its own messages (:class:`WebSocketFrames`), where SSE readers
   share the frame cache's: an event message carries the stream id, so it cannot be one
   of the cache's SSE frames, and a WebSocket fan-out of one stream to many sockets is not
   the case this transport is for. The native data text is the renderer's, not re-parsed.

Close codes (RFC 6455 section 7.4.1):

======  ===========================================================================
1000    normal: the client closed
1008    the socket did not drain for the send timeout and a stream it read was not
        resumable (that stream was cancelled: there is nothing to come back to)
1009    a client message over :attr:`WebSocketLimits.max_message_bytes`
1011    the client did not answer the server's ping in time
1012    the server is restarting (drain): reconnect and resubscribe
1013    the socket did not drain for the send timeout: reconnect and resubscribe from
        the last id received (resumable streams wait their grace window)
======  ===========================================================================

A handshake the server refuses is answered with an HTTP status and the JSON error body:
``403`` (an ``Origin`` the CORS settings do not allow), ``401`` (a wrong or missing key),
``421`` (a ``Host`` it does not answer for), ``404`` (another path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from sluice.errors import BadRequestError
from sluice.events import NeutralEvent, TextDelta
from sluice.streams.log import Batch
from sluice.transports.native_json import native_message

__all__ = [
    "CLOSE_NOT_RESUMABLE",
    "CLOSE_TRY_AGAIN",
    "Cancel",
    "ClientMessage",
    "Create",
    "Subscribe",
    "WebSocketFrames",
    "WebSocketLimits",
    "created_message",
    "error_message",
    "parse_client_message",
    "server_text_frame",
]

# RFC 6455 section 5.2: FIN and the text opcode; the payload lengths that take 7, 16 or 64
# bits (a server's frames are never masked: section 5.1).
_FIN_TEXT = 0x81
_LENGTH_16 = 126
_LENGTH_64 = 127
CLOSE_NOT_RESUMABLE = 1008  # policy violation: a stuck socket pinned a non-resumable stream
CLOSE_TRY_AGAIN = 1013  # try again later: a stuck socket, its streams can be resumed
_END = b"\n"  # ends every message this module encodes (JSON text never holds a raw LF)
# What follows the id in a token's ``event`` message, up to its data.
_TOKEN_MIDDLE = b'","event":"token","data":'


@dataclass(frozen=True, slots=True)
class WebSocketLimits:
    """The bounds of one WebSocket."""

    # A ``create`` carries a ``POST /v1/streams`` body (at most 1 MiB) and its envelope.
    max_message_bytes: int = 1024 * 1024 + 1024
    # Streams one socket may read at once: bounds its readers and its send queue.
    max_streams: int = 32
    # Messages waiting for the socket before its streams pause (and start coalescing).
    # The queue then holds at most this plus one delivery batch per stream.
    max_queued_messages: int = 256
    # A paused socket's streams resume when its queue is down to this many.
    resume_queued_messages: int = 64
    # How long the server waits for the close frame to go out on a stuck socket.
    close_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024 or self.max_streams < 1:
            raise ValueError("WebSocket limits must allow a request and a stream")
        if not 0 <= self.resume_queued_messages < self.max_queued_messages:
            raise ValueError("resume_queued_messages must be below max_queued_messages")
        if not self.close_timeout_s > 0:
            raise ValueError("close_timeout_s must be positive")


@dataclass(frozen=True, slots=True)
class Create:
    request: dict[str, object]


@dataclass(frozen=True, slots=True)
class Subscribe:
    stream_id: str
    last_event_id: str | None


@dataclass(frozen=True, slots=True)
class Cancel:
    stream_id: str


ClientMessage = Create | Subscribe | Cancel


def json_object_message(text: str) -> dict[str, object]:
    """A client text message as the JSON object every socket protocol here takes; raises
    :class:`~sluice.errors.BadRequestError` for anything else."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"message is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise BadRequestError("message must be a JSON object with a 'type'")
    return value


def parse_client_message(text: str) -> ClientMessage:
    """One client message; raises :class:`~sluice.errors.BadRequestError` saying what is
    wrong with it (choice 2)."""
    value = json_object_message(text)
    kind = value.get("type")
    if kind == "create":
        request = value.get("request")
        if not isinstance(request, dict):
            raise BadRequestError("create: 'request' must be the object POST /v1/streams takes")
        return Create(request)
    if kind == "subscribe":
        last_event_id = value.get("last_event_id")
        if last_event_id is not None and not isinstance(last_event_id, str):
            raise BadRequestError("subscribe: 'last_event_id' must be a string or null")
        return Subscribe(_stream_id(value, "subscribe"), last_event_id or None)
    if kind == "cancel":
        return Cancel(_stream_id(value, "cancel"))
    shown = repr(kind)[:40]
    raise BadRequestError(f"unknown message type {shown}: use create, subscribe or cancel")


def _stream_id(value: dict[str, object], kind: str) -> str:
    stream_id = value.get("stream_id")
    if not isinstance(stream_id, str):
        raise BadRequestError(f"{kind}: 'stream_id' must be a string")
    return stream_id


def created_message(stream: dict[str, object]) -> bytes:
    """The ``created`` message for a stream's ``POST /v1/streams`` answer."""
    return orjson.dumps({"type": "created", "stream": stream}) + _END


def error_message(code: str, message: str, stream_id: str | None = None) -> bytes:
    """An ``error`` message (a refusal; not an event of the stream's log)."""
    payload: dict[str, object] = {"type": "error", "code": code, "message": message}
    if stream_id is not None:
        payload["stream_id"] = stream_id
    return orjson.dumps(payload) + _END


def split_messages(body: bytes) -> list[bytes]:
    """The messages of a body joined by this module's encoders (each ends with ``LF``)."""
    return body.split(_END)[:-1]


class WebSocketFrames:
    """One subscription's events as ``event`` messages: the delivery core's
    :class:`~sluice.transports.frames.FrameSource` for a WebSocket (each message ends with
    ``LF``, which the shell splits on: one text frame each)."""

    __slots__ = ("_head", "_stream_id")

    retry_hint = False  # a WebSocket client resubscribes by itself

    def __init__(self, stream_id: str) -> None:
        self._stream_id = stream_id
        # Every message of the subscription begins so, up to the event's number.
        self._head = f'{{"type":"event","stream_id":"{stream_id}","id":"{stream_id}:'.encode()

    def _encode(self, seq: int, event: NeutralEvent) -> bytes:
        if type(event) is TextDelta:  # the hot path: one per token (the native data text)
            return b"%s%d%s%s}\n" % (
                self._head,
                seq,
                _TOKEN_MIDDLE,
                orjson.dumps({"text": event.text}),
            )
        name, data = native_message(event)
        return b'%s%d","event":"%s","data":%s}\n' % (self._head, seq, name.encode(), data.encode())

    def body(self, batch: Batch) -> bytes:
        events = batch.events
        if len(events) == 1:  # a caught-up reader reads one event a wake
            return self._encode(batch.first_seq, events[0])
        return b"".join(self.frames(batch))

    def frames(self, batch: Batch) -> Sequence[bytes]:
        encode = self._encode
        first_seq = batch.first_seq
        return [encode(first_seq + i, event) for i, event in enumerate(batch.events)]

    def merged_tokens(self, text: str, seq: int) -> bytes | None:
        return self._encode(seq, TextDelta(text))

    def refusal(self, code: str, message: str, after_seq: int) -> bytes:
        return error_message(code, message, self._stream_id)


def server_text_frame(payload: bytes) -> bytes:
    """One unfragmented, unmasked text frame of ``payload`` (UTF-8 already), as a server
    sends it with no extension negotiated (RFC 6455 section 5.2)."""
    size = len(payload)
    if size < _LENGTH_16:
        return bytes((_FIN_TEXT, size)) + payload
    if size < 1 << 16:
        return bytes((_FIN_TEXT, _LENGTH_16)) + size.to_bytes(2, "big") + payload
    return bytes((_FIN_TEXT, _LENGTH_64)) + size.to_bytes(8, "big") + payload
