"""``GET /v1/ws``: the native API over one WebSocket (the protocol is
:mod:`sluice.transports.websocket_protocol`, the shell :mod:`sluice.transports.websocket`).

The handshake is checked as an HTTP request is: the ``Host`` (``421``), then the
``Origin`` (``403``), then the caller (``401``), each refusal an HTTP answer with the JSON
error body, before the socket is accepted. The caller is the key of ``Authorization:
Bearer`` (or ``x-api-key``), or, for browsers, which cannot set headers on a WebSocket, a
resume token as ``?token=``, which lets the socket read and cancel that one stream.

``Origin``: a browser's WebSocket is not subject to CORS (there is no preflight), so the
handshake checks it against the same settings: the server's own origin (the page at ``/``)
and the origins ``--cors-origin`` allows (any, when every caller needs a key). A request
with no ``Origin`` comes from no browser and is not checked.

Each client message is then answered on the socket, in order: ``create`` as ``POST
/v1/streams`` (the socket is subscribed to the new stream from its start), ``subscribe``
as the SSE read with a ``Last-Event-ID``, ``cancel`` as ``POST /v1/streams/{id}/cancel``;
a refusal is an ``error`` frame with the code the HTTP API answers with (one table:
:func:`~sluice.gateway.errors.answer_for`), and the socket stays open.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from starlette.responses import Response

from sluice.errors import BadEventIdError, BadRequestError, SluiceError
from sluice.gateway.auth import TOKEN_PARAM, Auth, Caller, presented_token
from sluice.gateway.cors import CorsPolicy
from sluice.gateway.creation import create_native_stream
from sluice.gateway.cursor import open_reader_at
from sluice.gateway.errors import answer_for, error_response, response_for
from sluice.gateway.hosts import HostPolicy
from sluice.gateway.settings import Settings
from sluice.observability.metrics import Metrics
from sluice.streams.hub import Stream, StreamHub
from sluice.streams.ids import is_stream_id, parse_position
from sluice.transports.asgi import Receive, Scope, Send
from sluice.transports.websocket import WebSocketSession
from sluice.transports.websocket_protocol import (
    Cancel,
    Create,
    WebSocketLimits,
    created_message,
    error_message,
    parse_client_message,
)

__all__ = ["WS_PATH", "WebSockets", "check_handshake", "origin_allowed", "refuse_handshake"]

WS_PATH = "/v1/ws"
_DEFAULT_PORTS = {"http": ":80", "https": ":443"}


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value)
    return None


def origin_allowed(scope: Scope, cors: CorsPolicy) -> bool:
    """Whether a WebSocket handshake's ``Origin`` may open a socket (see the module doc)."""
    origin = _header(scope, b"origin")
    if origin is None or cors.allows(origin):
        return True
    scheme, sep, authority = origin.decode("latin-1").lower().partition("://")
    host = (_header(scope, b"host") or b"").decode("latin-1").lower()
    if not sep or not host:
        return False
    default_port = _DEFAULT_PORTS.get(scheme)
    if default_port is not None:
        host = host.removesuffix(default_port)
    return authority == host


def check_handshake(
    scope: Scope, auth: Auth, *, cors: CorsPolicy, hosts: HostPolicy
) -> Caller | Response:
    """A WebSocket handshake's caller, or the answer that refuses it (see the module doc:
    ``Host``, then ``Origin``, then the caller); raises the errors of the HTTP API's
    checks (``Host``, key). Every WebSocket endpoint checks its handshake so."""
    hosts.check(scope)
    if not origin_allowed(scope, cors):
        origin = (_header(scope, b"origin") or b"").decode("latin-1")[:80]
        message = f"origin {origin!r} may not open WebSockets to this server"
        return error_response(403, "origin_refused", message)
    query = parse_qs(scope["query_string"].decode("latin-1"))
    tokens = query.get(TOKEN_PARAM)
    headers = scope["headers"]
    return auth.caller(headers, presented_token(headers, tokens[-1] if tokens else None))


class WebSockets:
    """Serves ``GET /v1/ws`` over one hub."""

    def __init__(
        self,
        hub: StreamHub,
        settings: Settings,
        metrics: Metrics,
        auth: Auth,
        *,
        cors: CorsPolicy,
        hosts: HostPolicy,
        limits: WebSocketLimits | None = None,
    ) -> None:
        self._hub = hub
        self._settings = settings
        self._metrics = metrics
        self._auth = auth
        self._cors = cors
        self._hosts = hosts
        self.limits = limits or WebSocketLimits()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            caller = self._handshake(scope)
        except SluiceError as exc:
            caller = response_for(exc)
        if isinstance(caller, Response):
            await refuse_handshake(scope, send, caller)
            return
        await send({"type": "websocket.accept"})

        async def handle(session: WebSocketSession, text: str) -> None:
            await self._handle(session, text, scope, caller)

        session = WebSocketSession(scope, send, self._settings.delivery, self.limits)
        await session.serve(receive, handle)

    def _handshake(self, scope: Scope) -> Caller | Response:
        """The socket's caller, or the answer that refuses it; raises the errors of the
        HTTP API's checks (``Host``, key)."""
        if scope["path"] != WS_PATH:
            return error_response(404, "not_found", "WebSockets are served at /v1/ws")
        return check_handshake(scope, self._auth, cors=self._cors, hosts=self._hosts)

    async def _handle(
        self, session: WebSocketSession, text: str, scope: Scope, caller: Caller
    ) -> None:
        """Answer one client message on ``session``."""
        stream_id: str | None = None
        try:
            message = parse_client_message(text)
            if isinstance(message, Create):
                await self._create(session, message, scope)
                return
            stream_id = message.stream_id[:80]
            if is_stream_id(message.stream_id):
                await self._hub.attach(message.stream_id)  # a stream another replica runs
            if isinstance(message, Cancel):
                self._hub.cancel(self._stream(message.stream_id, caller).id)
                return
            self._subscribe(session, message.stream_id, message.last_event_id, caller)
        except SluiceError as exc:
            answer = answer_for(exc)
            session.send_message(error_message(answer.code, answer.message, stream_id))

    def _stream(self, stream_id: str, caller: Caller) -> Stream:
        if not is_stream_id(stream_id):
            raise BadEventIdError(f"malformed stream id {stream_id[:80]!r}")
        return self._auth.find(self._hub.get, stream_id, caller)

    def _check_room(self, session: WebSocketSession) -> None:
        limit = self.limits.max_streams
        if session.num_streams >= limit:
            raise BadRequestError(f"this socket reads {limit} streams, its maximum")

    async def _create(self, session: WebSocketSession, message: Create, scope: Scope) -> None:
        try:
            self._check_room(session)
            tenant = self._auth.creator(scope["headers"])
        except SluiceError as exc:
            self._metrics.refused_before_start(exc)
            raise
        created = await create_native_stream(
            self._hub, self._settings, self._metrics, message.request, scope, tenant
        )
        stream, first = created.stream, created.refused
        if first is not None:  # the backend refused it before it started
            session.send_message(error_message(first.type, first.message))
            return
        token = self._auth.tokens.mint(stream.id)
        base = f"/v1/streams/{stream.id}"
        described = {
            **stream.describe(),
            "events_url": f"{base}/events?{TOKEN_PARAM}={token}",
            "cancel_url": f"{base}/cancel",
            "resume_token": token,
        }
        session.send_message(created_message(described))
        reader = open_reader_at(self._hub, self._metrics, stream, 0)
        if reader is not None:
            session.subscribe(reader, resumable=stream.resumable)

    def _subscribe(
        self,
        session: WebSocketSession,
        stream_id: str,
        last_event_id: str | None,
        caller: Caller,
    ) -> None:
        if session.is_subscribed(stream_id):
            raise BadRequestError(f"this socket already reads stream {stream_id}")
        self._check_room(session)
        after_seq = 0
        if last_event_id is not None:
            position_stream, after_seq, num_frames = parse_position(last_event_id)
            if num_frames:
                raise BadEventIdError(
                    f"last_event_id {last_event_id!r} is a frame id; give an event id"
                )
            if position_stream != stream_id:
                raise BadEventIdError(
                    f"last_event_id belongs to stream {position_stream}, not {stream_id}"
                )
        stream = self._stream(stream_id, caller)
        if last_event_id is not None:
            self._metrics.resumes.inc()
        reader = open_reader_at(self._hub, self._metrics, stream, after_seq)
        if reader is None:
            at = last_event_id or f"{stream_id}:0"
            message = f"nothing after {at}: the stream has ended"
            session.send_message(error_message("stream_ended", message, stream_id))
            return
        session.subscribe(reader, resumable=stream.resumable)


async def refuse_handshake(scope: Scope, send: Send, response: Response) -> None:
    """Answer a handshake with ``response`` (an HTTP status and its JSON body) where the
    server can (ASGI's WebSocket Denial Response), else with a bare ``403``."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    await send(
        {
            "type": "websocket.http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "websocket.http.response.body", "body": bytes(response.body)})
