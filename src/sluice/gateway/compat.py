"""The compatible APIs: one generic handler for every dialect of the registry
(:data:`sluice.dialects.registry.API_DIALECTS`: OpenAI Chat Completions and Completions,
Anthropic Messages, ...), each at its ``POST`` path, streaming (``"stream": true``) or not.

One handler, two shells. :meth:`CompatAPI.prepare` (the body, the stream) and
:meth:`CompatAPI.complete` (admission, then the answer) return what a request gets as an
:data:`~sluice.transports.answer.Answer`; a Starlette route per dialect writes it as a
plain ASGI response, and the native HTTP/1.1 path of ``sluice serve``
(:mod:`sluice.gateway.protocol`) writes the same answer itself, with the same delivery
core as native streams.

Each request becomes a stream of the hub like any other, read from its first event and
rendered in the client's dialect: the frame cache (:mod:`sluice.transports.frames`)
encodes its events once, in the producer's append; how it renders is kept with the
stream (:class:`~sluice.events.RenderMeta`), so a resume renders the same. Admission is
decided before the response starts: the handler waits for the stream's first event
(``Started``, or the ``Error`` of a backend that refused the work) and answers a refusal
with the right status in the dialect's error shape (400 bad request, 404 unknown model,
413 body too large, 503 + ``Retry-After`` when full, 502 when the backend failed). A
client that leaves before its answer is written cancels the generation (a
``"stream": false`` request is then answered 499, which nobody reads).

Resumable streams (opt-in): a request with the header ``X-Sluice-Resumable: true`` gets
SSE ids (``<stream id>:<n>``, on the last frame an event renders to) and survives a
disconnect for the grace window; ``GET /v1/streams/{id}/events`` with ``Last-Event-ID``
resumes it in the same dialect. The stream id comes back in ``X-Sluice-Stream-Id``, and a
resume token (see :mod:`sluice.gateway.auth`) in ``X-Sluice-Resume-Token``.
Without the header a disconnect cancels the generation at once (what OpenAI-compatible
clients expect), and the frames carry no ids.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.routing import Route

from sluice.dialects.base import ApiDialect, ParsedRequest
from sluice.dialects.registry import API_DIALECTS
from sluice.errors import CapacityError, InvalidParameterError, SluiceError
from sluice.events import Error, RenderMeta
from sluice.gateway.auth import RESUME_TOKEN_HEADER, Auth
from sluice.gateway.errors import REFUSAL_STATUS, answer_for, retry_after
from sluice.gateway.requests import (
    check_json_head,
    parse_json,
    receive_body,
    received,
    version_headers,
    with_version,
)
from sluice.gateway.settings import Settings
from sluice.gateway.streaming import whole_response
from sluice.observability.metrics import Metrics
from sluice.streams.hub import Stream, StreamHub
from sluice.streams.reader import Reader
from sluice.transports.answer import Answer, Streamed, Whole, send_answer
from sluice.transports.asgi import Receive, Scope, Send
from sluice.transports.delivery import DeliveryOptions
from sluice.transports.disconnect import until_disconnect
from sluice.transports.frames import FrameCache, encoder_for, frame_source

__all__ = ["RESUMABLE_HEADER", "STREAM_ID_HEADER", "BodyReader", "CompatAPI", "Prepared"]

RESUMABLE_HEADER = "x-sluice-resumable"
STREAM_ID_HEADER = "X-Sluice-Stream-Id"

BodyReader = Callable[[int], Awaitable[bytes]]
"""A request's body, at most ``max_bytes`` of it (``PayloadTooLargeError`` past that)."""

# The codes OpenAI itself puts in ``error.code``; other errors leave it null, as OpenAI does.
_OPENAI_CODES = frozenset({"model_not_found", "invalid_api_key"})
# "Client closed request": the answer to a whole request whose client left (nobody reads it).
_CLIENT_GONE = Whole(499)


@dataclass(slots=True, eq=False)
class Prepared:
    """A request's stream, created, with the reader its answer reads it with."""

    speaker: ApiDialect
    parsed: ParsedRequest
    meta: RenderMeta
    stream: Stream
    reader: Reader
    # X-Sluice-Model-Version for a model alias's stream (read at creation: a finished
    # stream lets go of its generation).
    versioned: tuple[tuple[bytes, bytes], ...] = ()


class CompatAPI:
    """The compatible endpoints over one hub."""

    def __init__(
        self,
        hub: StreamHub,
        settings: Settings,
        options: DeliveryOptions,
        metrics: Metrics,
        auth: Auth,
        frames: FrameCache,
    ) -> None:
        self._hub = hub
        self._settings = settings
        self.options = options
        self._metrics = metrics
        self._auth = auth
        self._frames = frames
        self._by_path = {speaker.path: speaker for speaker in API_DIALECTS}

    def routes(self) -> list[Route]:
        """One ``POST`` route per dialect of the registry (the ASGI shell)."""
        return [
            Route(speaker.path, _Endpoint(self, speaker), methods=["POST"])
            for speaker in API_DIALECTS
        ]

    def dialect_at(self, path: str) -> ApiDialect | None:
        """The dialect whose endpoint is ``path``, if any."""
        return self._by_path.get(path)

    # -- one request ----------------------------------------------------------------------

    async def answer(self, speaker: ApiDialect, scope: Scope, body: BodyReader) -> Answer:
        """:meth:`prepare`, then :meth:`complete` (the native path: its task is cancelled
        when the client leaves, which cancels the generation)."""
        prepared = await self.prepare(speaker, scope, body)
        if isinstance(prepared, Whole):
            return prepared
        return await self.complete(prepared)

    async def prepare(
        self, speaker: ApiDialect, scope: Scope, body: BodyReader
    ) -> Prepared | Whole:
        """Read and parse the body and create the stream; or the refusal."""
        try:
            tenant = self._auth.creator(scope["headers"])
            max_bytes = self._settings.http.max_body_bytes
            check_json_head(scope, max_bytes)
            payload = parse_json(await body(max_bytes))
            parsed = speaker.parse(payload, self._settings.request_limits)
            resumable = _header(scope, RESUMABLE_HEADER.encode()).lower() == b"true"
            stream = await self._hub.create(
                parsed.model,
                received(parsed.generation, scope, tenant),
                resumable=resumable,
                tenant=tenant,
            )
        except SluiceError as exc:
            self._metrics.refused_before_start(exc)
            return self._error(speaker, exc)
        meta = RenderMeta(
            dialect=speaker.name,
            response_id=speaker.response_id_prefix + stream.id.removeprefix("str_"),
            model=parsed.model,
            created=int(stream.created),
            resumable=resumable,
            include_usage=parsed.include_usage,
            options=with_version(parsed.options, stream.generation),
        )
        stream.render = meta
        # Before the producer's first append (it has not run yet): how the cache encodes
        # this stream; a whole answer needs no frames.
        self._frames.encode_as(stream.id, encoder_for(meta, stream.id) if parsed.stream else None)
        # Read from now: a client that leaves during admission cancels the stream.
        reader = self._hub.open_reader(stream.id, 0)
        versioned = tuple(
            (name.lower().encode(), value.encode())
            for name, value in version_headers(stream.generation).items()
        )
        return Prepared(speaker, parsed, meta, stream, reader, versioned)

    async def complete(self, prepared: Prepared) -> Answer:
        """Wait for admission; then the stream to deliver, or the whole answer. Closes the
        reader unless it hands it over in a :class:`Streamed` answer."""
        speaker, stream, reader = prepared.speaker, prepared.stream, prepared.reader
        handed = False
        try:
            first = await self._hub.first_event(stream.id)
            if isinstance(first, Error):
                self._metrics.refusals.labels(first.type).inc()
                return self._refused(speaker, first, stream.refusal)
            if not prepared.parsed.stream:
                return await self._whole(prepared)
            frames = frame_source(self._frames, self._hub.log, stream.id, prepared.meta, 0)
            headers = (
                *(
                    (name.lower().encode(), value.encode())
                    for name, value in speaker.headers(prepared.meta).items()
                ),
                (STREAM_ID_HEADER.lower().encode(), stream.id.encode()),
                # Resumes (GET /v1/streams/{id}/events?token=) need no key with it.
                (RESUME_TOKEN_HEADER.lower().encode(), self._auth.tokens.mint(stream.id).encode()),
                *prepared.versioned,
            )
            handed = True
            return Streamed(reader, frames, headers)
        finally:
            if not handed:
                reader.close()  # a client gone before the end cancels a non-resumable stream

    async def _whole(self, prepared: Prepared) -> Whole:
        """``"stream": false``: wait for the end, answer one JSON object."""
        accumulator = prepared.speaker.whole(prepared.meta)
        versioned = {name.decode(): value.decode() for name, value in prepared.versioned}
        async for batch in prepared.reader.batches(1024):
            for event in batch.events:
                accumulator.feed(event)
        failure = accumulator.error()
        if failure is not None:
            status, body = failure
            return whole_response(JSONResponse(body, status_code=status, headers=versioned))
        headers = {STREAM_ID_HEADER: prepared.stream.id, **versioned}
        return whole_response(JSONResponse(accumulator.result(), headers=headers))

    # -- errors in the dialect's shape ----------------------------------------------------

    def _error(self, speaker: ApiDialect, exc: SluiceError) -> Whole:
        answer = answer_for(exc)
        code = answer.code if answer.code in _OPENAI_CODES else None
        param = exc.param if isinstance(exc, InvalidParameterError) else None
        body = speaker.error_body(answer.status, answer.message, code=code, param=param)
        return whole_response(JSONResponse(body, status_code=answer.status, headers=answer.headers))

    def _refused(self, speaker: ApiDialect, error: Error, refusal: CapacityError | None) -> Whole:
        status = REFUSAL_STATUS.get(error.type, 500)
        headers = {}
        if status == 503:
            headers["Retry-After"] = retry_after(refusal.retry_after_s if refusal else 1.0)
        body = speaker.error_body(status, error.message, code=error.type)
        return whole_response(JSONResponse(body, status_code=status, headers=headers))


class _Endpoint:
    """The ASGI shell of one dialect's endpoint (a Starlette route's app)."""

    __slots__ = ("_api", "_speaker")

    def __init__(self, api: CompatAPI, speaker: ApiDialect) -> None:
        self._api = api
        self._speaker = speaker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self._api
        prepared = await api.prepare(self._speaker, scope, functools.partial(receive_body, receive))
        answer: Answer = _CLIENT_GONE
        if isinstance(prepared, Whole):
            answer = prepared
        else:
            async with until_disconnect(receive) as client:
                answer = await api.complete(prepared)
            if client.gone:
                if isinstance(answer, Streamed):
                    answer.reader.close()  # it left just as its stream was ready
                answer = _CLIENT_GONE
        await send_answer(answer, scope, receive, send, api.options)


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""
