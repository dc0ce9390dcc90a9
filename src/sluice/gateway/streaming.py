"""The SSE endpoints: ``GET /v1/streams/{id}/events`` and ``GET /v1/demo/words``.

:meth:`EventStreams.open` decides what a request gets (a stream to deliver, a 204, or an
error: an :data:`~sluice.transports.answer.Answer`); the transports write it, either as a
plain ASGI response (:meth:`EventStreams.__call__`, any ASGI server) or on the native
HTTP/1.1 path (:mod:`sluice.transports.http1`, ``sluice serve``, through
:mod:`sluice.gateway.protocol`). Both skip the framework's middleware stack: every
coroutine frame and wrapper here is multiplied by the number of held streams. So
:meth:`EventStreams.open` checks the ``Host`` itself, and the responses carry the app's
CORS headers. The frames a reader gets come from the frame cache
(:mod:`sluice.transports.frames`): encoded once per event, whoever reads them.

A read that cannot start where it asks, because the log no longer holds that position
(a fresh read included, when the stream's first events are gone), is answered
``410 Gone`` with a JSON error ``resume_gap`` before the response starts: EventSource
treats any status but 200 as final, so it stops instead of reconnecting to the same gap.
A reader that falls behind the log while reading gets the in-band ``resume_gap`` event
(the response has started); its reconnect, from its last id, is then such a ``410``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from urllib.parse import parse_qs

from starlette.responses import Response

from sluice.errors import (
    BadEventIdError,
    BadRequestError,
    CapacityError,
    SluiceError,
)
from sluice.gateway.auth import TOKEN_PARAM, Auth, Caller, presented_token
from sluice.gateway.cors import CorsPolicy
from sluice.gateway.cursor import readable_after
from sluice.gateway.errors import response_for
from sluice.gateway.hosts import HostPolicy
from sluice.gateway.requests import check_bounds, last_event_id, to_generation_request
from sluice.gateway.settings import Settings
from sluice.observability.metrics import Metrics
from sluice.sse import encode_retry
from sluice.streams.hub import Stream, StreamHub
from sluice.streams.ids import is_stream_id
from sluice.streams.reader import Reader
from sluice.transports.answer import Answer, Streamed, Whole, send_answer
from sluice.transports.asgi import Receive, Scope, Send
from sluice.transports.frames import FrameCache, FrameSource, frame_source
from sluice.transports.sse import SSE_HEADERS

__all__ = ["EventStreams", "refusal", "whole_response"]

# The demo's default pace: slow enough to watch words arrive one by one.
_DEMO_INTERVAL_MS = 50.0
_STREAMS_PREFIX = "/v1/streams/"
_EVENTS_SUFFIX = "/events"
_DEMO_PATH = "/v1/demo/words"


class EventStreams:
    """Serves SSE reads of the hub's streams."""

    def __init__(
        self,
        hub: StreamHub,
        settings: Settings,
        metrics: Metrics,
        auth: Auth,
        *,
        cors: CorsPolicy,
        hosts: HostPolicy,
        frames: FrameCache,
    ) -> None:
        self._hub = hub
        self._frames = frames
        self._settings = settings
        self._metrics = metrics
        self._auth = auth
        self._cors = cors
        self._hosts = hosts
        self.options = settings.delivery

    @staticmethod
    def handles(method: str, path: str) -> bool:
        """True for the requests this class serves."""
        return method == "GET" and EventStreams.serves_path(path)

    @staticmethod
    def serves_path(path: str) -> bool:
        """True for the paths of the SSE reads (only ``GET`` is served on them)."""
        if path == _DEMO_PATH:
            return True
        return path.startswith(_STREAMS_PREFIX) and path.endswith(_EVENTS_SUFFIX)

    def cors_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The app's CORS headers for an SSE response to this request."""
        return self._cors.response_headers(scope["headers"])

    async def open(self, scope: Scope) -> Answer:
        """What a request gets: its stream (with the app's CORS headers), a ``204`` when
        nothing is left (EventSource then stops reconnecting), or an error answer."""
        cors = self.cors_headers(scope)
        try:
            opened = await self._open_request(scope)
        except SluiceError as exc:
            # With the CORS headers too: a fetch-based SSE client reads the error's body.
            return _with_headers(refusal(exc), cors)
        if opened is None:
            return _with_headers(_NO_CONTENT, cors)
        reader, frames = opened
        return Streamed(reader, frames, cors)

    async def _open_request(self, scope: Scope) -> tuple[Reader, FrameSource] | None:
        """The reader a request gets and its frames, or ``None`` when nothing is left.

        Raises :class:`~sluice.errors.SluiceError` for requests that get an error answer.
        """
        self._hosts.check(scope)  # the native fast path reaches this without the app
        path: str = scope["path"]
        query = parse_qs(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        tokens = query.get(TOKEN_PARAM)
        caller = self._auth.caller(
            scope["headers"], presented_token(scope["headers"], tokens[-1] if tokens else None)
        )
        position = last_event_id(scope, query)
        if position is not None and is_stream_id(position[0]):
            await self._hub.attach(position[0])  # a stream another replica runs
        if path == _DEMO_PATH:
            # EventSource reconnects to the URL it first opened, so a request that carries
            # a Last-Event-ID resumes that stream instead of starting another.
            if position is not None:
                return self._resume(position, None, caller)
            return await self._start_words(query, self._auth.creator(scope["headers"]))
        stream_id = path[len(_STREAMS_PREFIX) : -len(_EVENTS_SUFFIX)]
        if not is_stream_id(stream_id):
            raise BadEventIdError(f"malformed stream id {stream_id[:80]!r}")
        if position is None:
            await self._hub.attach(stream_id)
            return self._open(self._stream(stream_id, caller), 0, 0)
        return self._resume(position, stream_id, caller)

    def _stream(self, stream_id: str, caller: Caller) -> Stream:
        """The stream, if ``caller`` may read it; else exactly what an unknown id gets."""
        return self._auth.find(self._hub.get, stream_id, caller)

    def _open(self, stream: Stream, after_seq: int, skip: int) -> tuple[Reader, FrameSource] | None:
        log = self._hub.log
        meta = stream.render
        if skip and (meta is None or after_seq >= log.last_seq(stream.id)):
            raise BadEventIdError(f"Last-Event-ID names a frame stream {stream.id} never sent")
        if not readable_after(self._hub, stream, after_seq, self._metrics):
            return None
        # A compatible stream resumes in its dialect; a frame id it never sent is refused
        # here, before the reader exists.
        frames = frame_source(self._frames, log, stream.id, meta, after_seq, skip)
        return self._hub.open_reader(stream.id, after_seq), frames

    def _resume(
        self, position: tuple[str, int, int], stream_id: str | None, caller: Caller
    ) -> tuple[Reader, FrameSource] | None:
        position_stream, after_seq, frames = position
        if stream_id is not None and position_stream != stream_id:
            raise BadEventIdError(
                f"Last-Event-ID belongs to stream {position_stream}, not {stream_id}"
            )
        stream = self._stream(position_stream, caller)
        self._metrics.resumes.inc()
        return self._open(stream, after_seq, frames)

    async def _start_words(
        self, query: dict[str, list[str]], tenant: str
    ) -> tuple[Reader, FrameSource]:
        texts = query.get("text")
        if not texts:
            raise BadRequestError("text: required query parameter")
        text = texts[-1]
        interval_value = _number(query, "interval_ms")
        interval_ms = _DEMO_INTERVAL_MS if interval_value is None else interval_value
        max_tokens_value = _number(query, "max_tokens")
        max_tokens = None if max_tokens_value is None else int(max_tokens_value)
        if max_tokens_value is not None and max_tokens != max_tokens_value:
            raise BadRequestError("max_tokens: must be an integer")
        check_bounds(text, interval_ms, max_tokens, self._settings)
        stream = await self._hub.create(
            "words",
            to_generation_request(text, interval_ms, max_tokens),
            resumable=True,
            tenant=tenant,
        )
        frames = frame_source(self._frames, self._hub.log, stream.id, None, 0)
        return self._hub.open_reader(stream.id, 0), frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one SSE request as a plain ASGI app."""
        await send_answer(await self.open(scope), scope, receive, send, self.options)


_NO_CONTENT = Whole(204)


def _with_headers(answer: Whole, headers: Sequence[tuple[bytes, bytes]]) -> Whole:
    return dataclasses.replace(answer, headers=(*answer.headers, *headers)) if headers else answer


def refusal(exc: SluiceError) -> Whole:
    """How an SSE read answers an error.

    A transient refusal (a full or draining server) is a ``200`` whose body is only a
    jittered ``retry:`` hint: EventSource treats any other status as final and stops
    reconnecting, while this makes it come back after the hint (to any replica).
    """
    if isinstance(exc, CapacityError):
        retry_ms = round(exc.retry_after_s * 1000 * random.uniform(1.0, 1.5))
        return Whole(200, SSE_HEADERS, encode_retry(retry_ms))
    return whole_response(response_for(exc))


def whole_response(response: Response) -> Whole:
    """A Starlette response with a body as a transport's :class:`Whole` answer."""
    return Whole(response.status_code, tuple(response.raw_headers), bytes(response.body))


def _number(query: dict[str, list[str]], name: str) -> float | None:
    values = query.get(name)
    if not values or values[-1] == "":
        return None
    try:
        value = float(values[-1])
    except ValueError:
        raise BadRequestError(f"{name}: not a number: {values[-1][:40]!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise BadRequestError(f"{name}: must be a finite number")
    return value
