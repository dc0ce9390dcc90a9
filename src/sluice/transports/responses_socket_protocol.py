"""The OpenAI Responses API's WebSocket mode at ``GET /v1/responses``, sans-IO: text in,
client messages out; a stream's Responses SSE frames in, WebSocket messages out. No
socket, no event loop (the gateway's side is :mod:`sluice.gateway.responses_socket`, the
shell :class:`~sluice.transports.websocket.WebSocketSession`, shared with ``/v1/ws``).

Every message is one JSON object in one text frame (RFC 6455 section 5.6), as the
official SDK's ``client.responses.connect()`` sends and reads them.

Client to server:

===================  ========================================================================
``response.create``  the body of ``POST /v1/responses`` with ``"type"`` (``stream`` is
                     implied; ``stream_id``, the SDK's "lane", is echoed on its events)
``response.cancel``  ``{"type": "response.cancel", "response_id": "resp_..."}``: aborts a
                     response of this socket still in progress (Sluice's own: the SDK
                     has no cancel event; it sends it unchanged with ``connection.send``)
===================  ========================================================================

Server to client: the Responses stream events of each response, exactly the JSON the
dialect (:mod:`sluice.dialects.openai_responses`) renders for SSE, ``type`` and
``sequence_number`` included, one message per event; and ``{"type": "error", "status",
"error": {"type", "code", "message", "param"}}`` for a refused message (the SDK's
``ResponseWsError``), the socket staying open.

Deliberate choices, numbered as the SSE codec's are:

1. The events are the SSE frames' data, taken from the frame cache
   (:mod:`sluice.transports.frames`): each event is encoded once, whichever transport
   reads it. The frames' SSE ids are dropped (a client of this mode does not resume).
2. ``stream_id`` (a lane) is echoed as the first field of each of its response's events
   and errors, as OpenAI does; without it the events are the SSE payloads unchanged.
3. Responses run side by side: a ``response.create`` starts at once, on any lane, up to
   the socket's stream limit; OpenAI queues a lane's creates in order. The SDK's lane
   helper waits for a response's terminal event before the next create on its lane, so
   it sees the same stream either way.
4. Refusals that are not a response's own events (a malformed message, an unknown type,
   a body the endpoint refuses, admission) are ``error`` messages with the HTTP status
   the endpoint would answer and OpenAI's error object; a ``503``'s ``Retry-After`` is in
   ``error.headers``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import orjson

from sluice.errors import BadRequestError
from sluice.streams.log import Batch
from sluice.transports.frames import FrameSource
from sluice.transports.websocket_protocol import json_object_message

__all__ = [
    "CANCEL",
    "CREATE",
    "CancelResponse",
    "CreateResponse",
    "ResponsesClientMessage",
    "ResponsesFrames",
    "error_event",
    "parse_responses_message",
    "sse_payloads",
]

CREATE = "response.create"
CANCEL = "response.cancel"
_END = b"\n"  # ends each message (JSON text never holds a raw LF): the shell splits on it
_FRAME_END = b"\n\n"
_DATA = b"data: "
_MAX_LANE_CHARS = 256  # a lane id is echoed on every event: bounded


@dataclass(frozen=True, slots=True)
class CreateResponse:
    """``response.create``: ``body`` is what ``POST /v1/responses`` would get."""

    body: dict[str, object]
    lane: str | None


@dataclass(frozen=True, slots=True)
class CancelResponse:
    response_id: str


ResponsesClientMessage = CreateResponse | CancelResponse


def parse_responses_message(text: str) -> ResponsesClientMessage:
    """One client message; raises :class:`~sluice.errors.BadRequestError` saying what is
    wrong with it (choice 4)."""
    value = json_object_message(text)
    kind = value.get("type")
    if kind == CREATE:
        lane = value.get("stream_id")
        if lane is not None and not (isinstance(lane, str) and 0 < len(lane) <= _MAX_LANE_CHARS):
            raise BadRequestError(
                f"response.create: 'stream_id' must be a string of 1 to {_MAX_LANE_CHARS} "
                "characters"
            )
        body = {k: v for k, v in value.items() if k not in ("type", "stream_id", "stream")}
        body["stream"] = True
        return CreateResponse(body, lane)
    if kind == CANCEL:
        response_id = value.get("response_id")
        if not isinstance(response_id, str):
            raise BadRequestError("response.cancel: 'response_id' must be a string")
        return CancelResponse(response_id)
    shown = repr(kind)[:40]
    raise BadRequestError(f"unknown message type {shown}: use {CREATE} or {CANCEL} on this socket")


def _lane_prefix(lane: str | None) -> bytes:
    return b"" if lane is None else b'{"stream_id":' + orjson.dumps(lane) + b","


def error_event(
    status: int,
    error: Mapping[str, object],
    lane: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """An ``error`` message: ``error`` is OpenAI's error object (``message``, ``type``,
    ``param``, ``code``) of a refusal answered with ``status``."""
    payload: dict[str, object] = {"type": "error", "status": status, "error": dict(error)}
    if headers:
        payload["error"] = {**error, "headers": dict(headers)}
    if lane is not None:
        payload = {"stream_id": lane, **payload}
    return orjson.dumps(payload) + _END


def sse_payloads(blob: bytes, lane: str | None = None) -> bytes:
    """The data of each SSE frame the encoders joined in ``blob``, one message each
    (choices 1 and 2). The dialect's data is one JSON object on one ``data:`` line."""
    if not blob:
        return b""
    prefix = _lane_prefix(lane)
    out = []
    for frame in blob.split(_FRAME_END)[:-1]:
        start = frame.find(_DATA)
        if start < 0 or (start and frame[start - 1 : start] != b"\n"):
            continue  # a comment: no event
        data = frame[start + len(_DATA) :]
        if prefix and data.startswith(b"{"):
            data = prefix + data[1:] if data != b"{}" else prefix[:-1] + b"}"
        out.append(data + _END)
    return b"".join(out)


class ResponsesFrames:
    """A reader's cached Responses SSE frames as WebSocket messages: the delivery core's
    :class:`~sluice.transports.frames.FrameSource` for this socket."""

    __slots__ = ("_lane", "_source")

    retry_hint = False  # nothing reconnects by itself here

    def __init__(self, source: FrameSource, lane: str | None) -> None:
        self._source = source
        self._lane = lane

    def body(self, batch: Batch) -> bytes:
        return sse_payloads(self._source.body(batch), self._lane)

    def frames(self, batch: Batch) -> Sequence[bytes]:
        return [sse_payloads(frame, self._lane) for frame in self._source.frames(batch)]

    def merged_tokens(self, text: str, seq: int) -> bytes | None:
        return None  # the Responses renderer is stateful: deltas are never merged

    def refusal(self, code: str, message: str, after_seq: int) -> bytes:
        return sse_payloads(self._source.refusal(code, message, after_seq), self._lane)
