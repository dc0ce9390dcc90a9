"""``GET /v1/streams/{id}/poll``: the long-poll read of a stream (see
:mod:`sluice.transports.longpoll` for the wire shape and the hold).

Who may poll is who may read the stream's SSE: its tenant (``Authorization: Bearer``) or a
holder of its resume token (``?token=`` or the header). Answers:

- ``200`` with the events after ``after`` (at once, or when the first arrives), or with
  ``"events": []`` when ``timeout_s`` passed first (or the server asked the reader to go);
- ``204`` when ``after`` is at or past the terminal event: nothing more will come;
- ``410`` ``resume_gap`` when the log no longer holds the position;
- ``400`` naming the parameter for a bad ``after`` or ``timeout_s``; ``404`` for a stream
  the caller may not read, known or not;
- ``503`` with ``Retry-After`` when the stream is another replica's and Redis cannot
  serve it here (:meth:`~sluice.streams.redis_hub.RedisStreamHub.attach`).

A poll holds a reader while it runs, so it counts as the stream's reader for the grace
window: the window stops while a poll is held and starts again when it answers. (A stream
created with ``"resumable": false`` is cancelled when its last reader leaves, a poll's
included: poll resumable streams.) A client that leaves mid-poll releases its reader at
once.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import Response

from sluice.errors import BadEventIdError, InvalidParameterError, SluiceError
from sluice.gateway.auth import TOKEN_PARAM, Auth, presented_token
from sluice.gateway.cursor import open_reader_at
from sluice.gateway.errors import response_for
from sluice.observability.metrics import Metrics
from sluice.streams.hub import StreamHub
from sluice.streams.ids import is_stream_id
from sluice.transports.longpoll import encode_poll, parse_poll_query, poll_once

__all__ = ["LongPolls"]

_HEADERS = {"Cache-Control": "no-store"}


class LongPolls:
    """Serves the long-poll reads of one hub's streams."""

    def __init__(self, hub: StreamHub, metrics: Metrics, auth: Auth) -> None:
        self._hub = hub
        self._metrics = metrics
        self._auth = auth

    async def poll(self, request: Request) -> Response:
        try:
            return await self._poll(request)
        except SluiceError as exc:
            return response_for(exc)

    async def _poll(self, request: Request) -> Response:
        scope = request.scope
        query = parse_qs(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        tokens = query.get(TOKEN_PARAM)
        headers = scope["headers"]
        caller = self._auth.caller(
            headers, presented_token(headers, tokens[-1] if tokens else None)
        )
        stream_id: str = request.path_params["stream_id"]
        if not is_stream_id(stream_id):
            raise BadEventIdError(f"malformed stream id {stream_id[:80]!r}")
        wanted = parse_poll_query(query, stream_id)
        await self._hub.attach(stream_id)  # a stream another replica runs
        stream = self._auth.find(self._hub.get, stream_id, caller)
        if wanted.after_seq:
            self._metrics.resumes.inc()
        try:
            reader = open_reader_at(self._hub, self._metrics, stream, wanted.after_seq)
        except BadEventIdError as exc:
            raise InvalidParameterError(f"after: {exc}", "after") from exc
        if reader is None:
            return Response(status_code=204, headers=_HEADERS)
        batch = await poll_once(reader, request.receive, wanted.timeout_s)
        body = encode_poll(stream_id, batch, after_seq=wanted.after_seq, done=reader.done)
        return Response(body, media_type="application/json", headers=_HEADERS)
