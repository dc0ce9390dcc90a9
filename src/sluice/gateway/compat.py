"""The compatible APIs: one generic handler for every dialect of the registry
(:data:`sluice.dialects.registry.API_DIALECTS`: OpenAI Chat Completions and Completions,
Anthropic Messages, ...), each at its ``POST`` path, streaming (``"stream": true``) or not.

Each request becomes a stream of the hub like any other, read from its first event and
rendered in the client's dialect by a :class:`DialectFramer`; how it renders is kept with
the stream (:class:`~sluice.events.RenderMeta`), so a resume renders the same. Admission is decided before
the response starts: the handler waits for the stream's first event (``Started``, or the
``Error`` of a backend that refused the work) and answers a refusal with the right status
in the dialect's error shape (400 bad request, 404 unknown model, 413 body too large,
503 + ``Retry-After`` when full, 502 when the backend failed).

Resumable streams (opt-in): a request with the header ``X-Sluice-Resumable: true`` gets
SSE ids (``<stream id>:<n>``, on the last frame an event renders to) and survives a
disconnect for the grace window; ``GET /v1/streams/{id}/events`` with ``Last-Event-ID``
resumes it in the same dialect. The stream id comes back in ``X-Sluice-Stream-Id``, and a
resume token (see :mod:`sluice.gateway.auth`) in ``X-Sluice-Resume-Token``.
Without the header a disconnect cancels the generation at once (what OpenAI-compatible
clients expect), and the frames carry no ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sluice.dialects.base import ApiDialect, Message, Renderer
from sluice.dialects.registry import API_DIALECTS, dialect
from sluice.errors import (
    BadEventIdError,
    CapacityError,
    InvalidParameterError,
    ResumeGapError,
    SluiceError,
)
from sluice.events import Error, NeutralEvent, RenderMeta
from sluice.gateway.auth import RESUME_TOKEN_HEADER, Auth
from sluice.gateway.errors import (
    REFUSAL_STATUS,
    answer_for,
    retry_after,
)
from sluice.gateway.requests import read_json_body, received, version_headers, with_version
from sluice.gateway.settings import Settings
from sluice.observability.metrics import Metrics
from sluice.sse import encode_event
from sluice.streams.hub import Stream, StreamHub
from sluice.streams.log import Batch, EventLog
from sluice.streams.reader import Reader
from sluice.transports.asgi import Receive, Scope, Send
from sluice.transports.sse import SSEOptions, send_event_stream

__all__ = ["RESUMABLE_HEADER", "CompatAPI", "DialectFramer", "framer_for"]

RESUMABLE_HEADER = "x-sluice-resumable"
STREAM_ID_HEADER = "X-Sluice-Stream-Id"


class DialectFramer:
    """A reader's records as a dialect's SSE frames; ids only for resumable streams.

    The last frame an event renders to carries the event's id; frames before it carry
    frame ids (see :mod:`sluice.streams.ids`). ``first`` holds the frames of the first event
    to come, already rendered and with the ones a resuming client has dropped (it resumed
    from a frame id); the renderer has seen that event, so it is not rendered again.
    """

    __slots__ = ("_first", "_refuse", "_renderer", "_stream_id")

    def __init__(
        self,
        renderer: Renderer,
        stream_id: str | None,
        refuse: Callable[[str, str], Sequence[Message]],
        first: _RenderedEvent | None = None,
    ) -> None:
        self._renderer = renderer
        self._stream_id = stream_id
        self._refuse = refuse
        self._first = first

    def frame(self, batch: Batch) -> bytes:
        out: list[bytes] = []
        render = self._renderer.render
        stream_id = self._stream_id
        first, self._first = self._first, None
        for offset, event in enumerate(batch.events):
            seq = batch.first_seq + offset
            skip = 0
            if first is not None and offset == 0 and first.seq == seq:
                frames, skip = first.frames, first.skip
            else:
                frames = render(event)
            last = len(frames) - 1
            for i, (name, data) in enumerate(frames):
                if i < skip:
                    continue
                event_id = None
                if stream_id is not None:
                    event_id = (
                        f"{stream_id}:{seq}" if i == last else f"{stream_id}:{seq - 1}.{i + 1}"
                    )
                out.append(encode_event(data, event=name, id=event_id))
        return b"".join(out)

    def refusal(self, code: str, message: str) -> bytes:
        return b"".join(
            encode_event(data, event=name) for name, data in self._refuse(code, message)
        )


@dataclass(frozen=True, slots=True)
class _RenderedEvent:
    """Event ``seq`` rendered, of which the client already has the first ``skip`` frames."""

    seq: int
    frames: Sequence[Message]
    skip: int


def framer_for(
    meta: RenderMeta, log: EventLog, stream_id: str, after_seq: int, skip: int = 0
) -> DialectFramer:
    """A framer for a reader of a stream created in ``meta``'s dialect that starts after
    event ``after_seq`` (and ``skip`` frames of the next one).

    A dialect's frames depend on what came before (OpenAI's first chunk carries the
    role, Anthropic numbers its content blocks), so the renderer first replays events
    ``1 .. after_seq`` silently. If those are gone, the reader's own read fails with a
    resume gap, which :meth:`DialectFramer.refusal` reports. With ``skip``, the next
    event is rendered here, and a ``skip`` that leaves none of its frames (the client
    names a frame id ``<after_seq>.<skip>`` that was never sent) raises
    :class:`~sluice.errors.BadEventIdError` (a 400) before any response starts.
    """
    speaker = dialect(meta.dialect)
    renderer = speaker.renderer(meta)
    seq = 0
    first: _RenderedEvent | None = None
    with contextlib.suppress(ResumeGapError):
        while seq < after_seq:
            batch = log.read(stream_id, seq, after_seq - seq)
            if not batch.events:
                break
            for event in batch.events:
                renderer.render(event)
            seq = batch.last_seq
        if skip:
            first = _partly_sent(renderer, log, stream_id, after_seq, skip)

    def refuse(code: str, message: str) -> Sequence[Message]:
        return speaker.renderer(meta).render(Error(code, message, retryable=False))[-1:]

    return DialectFramer(renderer, stream_id if meta.resumable else None, refuse, first)


def _partly_sent(
    renderer: Renderer, log: EventLog, stream_id: str, after_seq: int, skip: int
) -> _RenderedEvent:
    """Event ``after_seq + 1`` rendered; refuses a ``skip`` past its last frame id."""
    batch = log.read(stream_id, after_seq, 1)
    frames = renderer.render(batch.events[0]) if batch.events else ()
    # Frame k (from 1) of an event is sent as "<after_seq>.<k>" for k below its count;
    # its last frame carries the event's own id.
    if skip >= len(frames):
        raise BadEventIdError(
            f"Last-Event-ID names frame {skip} of event {after_seq + 1} of stream "
            f"{stream_id}, which has {max(len(frames) - 1, 0)} frame ids before its own"
        )
    return _RenderedEvent(after_seq + 1, frames, skip)


# The codes OpenAI itself puts in ``error.code``; other errors leave it null, as OpenAI does.
_OPENAI_CODES = frozenset({"model_not_found", "invalid_api_key"})


class _EventStreamResponse(Response):
    """An SSE response that reads ``reader`` through its framer until the end."""

    def __init__(self, reader: Reader, options: SSEOptions, headers: list[tuple[bytes, bytes]]):
        super().__init__(status_code=200)
        self._reader = reader
        self._options = options
        self._extra = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_event_stream(
            receive, send, self._reader, self._options, extra_headers=self._extra
        )


class CompatAPI:
    """The compatible endpoints over one hub."""

    def __init__(
        self,
        hub: StreamHub,
        settings: Settings,
        options: SSEOptions,
        metrics: Metrics,
        auth: Auth,
    ) -> None:
        self._hub = hub
        self._settings = settings
        self._options = options
        self._metrics = metrics
        self._auth = auth

    def routes(self) -> list[Route]:
        """One ``POST`` route per dialect of the registry."""
        return [
            Route(speaker.path, functools.partial(self._serve, speaker=speaker), methods=["POST"])
            for speaker in API_DIALECTS
        ]

    # -- one request ----------------------------------------------------------------------

    async def _serve(self, request: Request, *, speaker: ApiDialect) -> Response:
        try:
            tenant = self._auth.creator(request.scope["headers"])
            payload = await read_json_body(
                request.scope, request.receive, self._settings.max_body_bytes
            )
            parsed = speaker.parse(payload, self._settings.request_limits)
            resumable = request.headers.get(RESUMABLE_HEADER, "").lower() == "true"
            stream = await self._hub.create(
                parsed.model,
                received(parsed.generation, request.scope, tenant),
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
        versioned = version_headers(stream.generation)  # a model alias's version
        first = await self._hub.first_event(stream.id)
        if isinstance(first, Error):
            self._metrics.refusals.labels(first.type).inc()
            return self._refused(speaker, first, stream.refusal)
        reader = self._hub.open_reader(stream.id, 0)
        if not parsed.stream:
            return await self._whole(request, speaker, meta, stream, reader, versioned)
        reader.framer = framer_for(meta, self._hub.log, stream.id, 0)
        headers = [
            *(
                (name.lower().encode(), value.encode())
                for name, value in speaker.headers(meta).items()
            ),
            (STREAM_ID_HEADER.lower().encode(), stream.id.encode()),
            # Resumes (GET /v1/streams/{id}/events?token=) need no key with it.
            (RESUME_TOKEN_HEADER.lower().encode(), self._auth.tokens.mint(stream.id).encode()),
            *((name.lower().encode(), value.encode()) for name, value in versioned.items()),
        ]
        return _EventStreamResponse(reader, self._options, headers)

    async def _whole(
        self,
        request: Request,
        speaker: ApiDialect,
        meta: RenderMeta,
        stream: Stream,
        reader: Reader,
        versioned: dict[str, str],
    ) -> Response:
        """``"stream": false``: wait for the end, answer one JSON object."""
        accumulator = speaker.whole(meta)
        try:
            events = await _read_all(reader, request.receive)
        finally:
            reader.close()  # a client gone before the end cancels a non-resumable stream
        if events is None:
            return Response(status_code=499)  # "client closed request"; nobody reads it
        for event in events:
            accumulator.feed(event)
        failure = accumulator.error()
        if failure is not None:
            status, body = failure
            return JSONResponse(body, status_code=status, headers=versioned)
        headers = {STREAM_ID_HEADER: stream.id, **versioned}
        return JSONResponse(accumulator.result(), headers=headers)

    # -- errors in the dialect's shape ----------------------------------------------------

    def _error(self, speaker: ApiDialect, exc: SluiceError) -> Response:
        answer = answer_for(exc)
        code = answer.code if answer.code in _OPENAI_CODES else None
        param = exc.param if isinstance(exc, InvalidParameterError) else None
        body = speaker.error_body(answer.status, answer.message, code=code, param=param)
        return JSONResponse(body, status_code=answer.status, headers=answer.headers)

    def _refused(
        self, speaker: ApiDialect, error: Error, refusal: CapacityError | None
    ) -> Response:
        status = REFUSAL_STATUS.get(error.type, 500)
        headers = {}
        if status == 503:
            headers["Retry-After"] = retry_after(refusal.retry_after_s if refusal else 1.0)
        body = speaker.error_body(status, error.message, code=error.type)
        return JSONResponse(body, status_code=status, headers=headers)


async def _read_all(reader: Reader, receive: Receive) -> list[NeutralEvent] | None:
    """Every event of the stream up to its terminal one; ``None`` if the client left."""
    loop = asyncio.get_running_loop()
    gone = asyncio.ensure_future(_until_disconnect(receive))
    events: list[NeutralEvent] = []
    try:
        while True:
            batch = reader.read(1024)
            events.extend(batch.events)
            if reader.done:
                return events
            if batch.events:
                continue
            arrived: asyncio.Future[None] = loop.create_future()
            reader.watch(arrived)
            try:
                await asyncio.wait((arrived, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                reader.unwatch(arrived)
            if gone.done():
                return None
    finally:
        gone.cancel()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
