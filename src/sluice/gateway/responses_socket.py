"""``GET /v1/responses`` upgraded to a WebSocket: the OpenAI Responses API's WebSocket
mode (the protocol is :mod:`sluice.transports.responses_socket_protocol`), what the
official SDK's ``client.responses.connect()`` speaks.

The socket is the native WebSocket's (:mod:`sluice.gateway.websocket`): the same
handshake checks (``Host``, ``Origin`` against the CORS settings, the caller's key), the
same shell (:class:`~sluice.transports.websocket.WebSocketSession`: pings, one bounded
send queue, the slow-client policy and its close codes, the message size limit), only
other messages.

A ``response.create`` is ``POST /v1/responses`` with ``"stream": true``: the same
handler (:class:`~sluice.gateway.compat.CompatAPI`, its ``prepare`` and ``complete``)
parses and checks the body, creates the stream and waits for its admission, and the
socket then reads the stream's cached Responses frames from its first event. A refusal
is an ``error`` message with the status and OpenAI error object the endpoint would
answer with; the socket stays open. ``response.cancel`` cancels a response this socket
created that is still in progress (as ``POST /v1/streams/{id}/cancel``): its stream ends
with the dialect's ``error`` (code ``cancelled``) and ``response.failed`` events. Closing
the socket detaches its readers: their streams are cancelled (no grace: they are not
resumable), and the engine frees their KV blocks.
"""

from __future__ import annotations

import orjson
from starlette.responses import Response

from sluice.dialects.base import ApiDialect
from sluice.dialects.registry import api_dialect
from sluice.errors import BadRequestError, InvalidParameterError, SluiceError
from sluice.gateway.auth import Auth
from sluice.gateway.compat import CompatAPI
from sluice.gateway.cors import CorsPolicy
from sluice.gateway.errors import PayloadTooLargeError, answer_for, response_for
from sluice.gateway.hosts import HostPolicy
from sluice.gateway.settings import Settings
from sluice.gateway.websocket import check_handshake, refuse_handshake
from sluice.streams.hub import StreamHub
from sluice.transports.answer import Streamed, Whole
from sluice.transports.asgi import Receive, Scope, Send
from sluice.transports.responses_socket_protocol import (
    CancelResponse,
    CreateResponse,
    ResponsesFrames,
    error_event,
    parse_responses_message,
)
from sluice.transports.websocket import WebSocketSession
from sluice.transports.websocket_protocol import WebSocketLimits

__all__ = ["RESPONSES_WS_PATH", "ResponsesSockets"]

RESPONSES_WS_PATH = "/v1/responses"
_DIALECT = "openai_responses"
_JSON_HEAD = (b"content-type", b"application/json")
_BODY_HEADERS = frozenset({b"content-type", b"content-length", b"transfer-encoding"})


class ResponsesSockets:
    """Serves ``GET /v1/responses`` (WebSocket) over the compatible handler."""

    def __init__(
        self,
        hub: StreamHub,
        compat: CompatAPI,
        settings: Settings,
        auth: Auth,
        *,
        cors: CorsPolicy,
        hosts: HostPolicy,
        limits: WebSocketLimits,
    ) -> None:
        self._hub = hub
        self._compat = compat
        self._settings = settings
        self._auth = auth
        self._cors = cors
        self._hosts = hosts
        self.limits = limits
        self._speaker: ApiDialect = api_dialect(_DIALECT)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            caller = check_handshake(scope, self._auth, cors=self._cors, hosts=self._hosts)
        except SluiceError as exc:
            caller = response_for(exc)
        if isinstance(caller, Response):
            await refuse_handshake(scope, send, caller)
            return
        await send({"type": "websocket.accept"})
        # The handshake's headers, as a JSON request's: what POST /v1/responses is checked by.
        headers = [(k, v) for k, v in scope["headers"] if k not in _BODY_HEADERS]
        request_scope: Scope = {**scope, "headers": [*headers, _JSON_HEAD]}
        live: dict[str, str] = {}  # response id -> stream id, of this socket's responses

        def refuse(code: str, message: str, stream_id: str | None) -> bytes:
            # The shell's own: a binary message (400), a response cut by the server (503).
            return self._error(400 if code == "invalid_request" else 503, message, code)

        async def handle(session: WebSocketSession, text: str) -> None:
            await self._handle(session, text, request_scope, live)

        session = WebSocketSession(scope, send, self._settings.delivery, self.limits, errors=refuse)
        await session.serve(receive, handle)

    async def _handle(
        self, session: WebSocketSession, text: str, scope: Scope, live: dict[str, str]
    ) -> None:
        """Answer one client message on ``session``."""
        lane: str | None = None
        try:
            message = parse_responses_message(text)
            if isinstance(message, CreateResponse):
                lane = message.lane
                await self._create(session, message, scope, live)
                return
            self._cancel(session, message, live)
        except SluiceError as exc:
            answer = answer_for(exc)
            param = exc.param if isinstance(exc, InvalidParameterError) else None
            error = self._error(answer.status, answer.message, answer.code, param, lane)
            session.send_message(error)

    def _error(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        lane: str | None = None,
    ) -> bytes:
        body = self._speaker.error_body(status, message, code=code, param=param)
        error = body.get("error")
        return error_event(status, error if isinstance(error, dict) else body, lane)

    async def _create(
        self,
        session: WebSocketSession,
        message: CreateResponse,
        scope: Scope,
        live: dict[str, str],
    ) -> None:
        limit = self.limits.max_streams
        if session.num_streams >= limit:
            raise BadRequestError(f"this socket reads {limit} responses at once, its maximum")
        body = orjson.dumps(message.body)

        async def read_body(max_bytes: int) -> bytes:
            if len(body) > max_bytes:
                raise PayloadTooLargeError(f"request body over {max_bytes} bytes")
            return body

        compat = self._compat
        prepared = await compat.prepare(self._speaker, scope, read_body)
        answer = prepared if isinstance(prepared, Whole) else await compat.complete(prepared)
        if isinstance(answer, Whole):
            session.send_message(_refusal(answer, message.lane))
            return
        if not isinstance(answer, Streamed) or isinstance(prepared, Whole):
            raise RuntimeError("a streamed Responses request was answered whole")
        stream = prepared.stream
        for response_id, stream_id in list(live.items()):
            if not session.is_subscribed(stream_id):
                del live[response_id]  # ended: bounded by the socket's stream limit
        live[prepared.meta.response_id] = stream.id
        frames = ResponsesFrames(answer.frames, message.lane)
        session.subscribe(answer.reader, resumable=stream.resumable, frames=frames)

    def _cancel(
        self, session: WebSocketSession, message: CancelResponse, live: dict[str, str]
    ) -> None:
        stream_id = live.get(message.response_id)
        if stream_id is None or not session.is_subscribed(stream_id):
            shown = message.response_id[:80]
            text = f"no response {shown!r} of this socket is in progress"
            session.send_message(self._error(404, text, "response_not_found"))
            return
        self._hub.cancel(stream_id)


def _refusal(answer: Whole, lane: str | None) -> bytes:
    """The ``error`` message of the endpoint's refusal ``answer`` (its JSON error body)."""
    body = orjson.loads(answer.body)
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {"message": "refused", "type": "server_error", "param": None, "code": None}
    headers = {
        name.decode(): value.decode() for name, value in answer.headers if name == b"retry-after"
    }
    return error_event(answer.status, error, lane, headers)
