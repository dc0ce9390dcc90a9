"""Client-side resume for the official SDKs: an HTTP transport that carries a resumable
Sluice stream across dropped connections, so the ``openai`` and ``anthropic`` SDKs (and any
``httpx2`` client) read one unbroken stream while gateways die, drain or move them::

    from openai import OpenAI
    import httpx2
    from sluice.client import ResumingTransport

    client = OpenAI(base_url=..., http_client=httpx2.Client(transport=ResumingTransport()))
    client.chat.completions.create(..., stream=True,
                                   extra_headers={"X-Sluice-Resumable": "true"})

(``AsyncResumingTransport`` does the same for ``AsyncOpenAI``/``AsyncAnthropic`` with an
``httpx2.AsyncClient``.) It takes part in a response only when the response is a Sluice
stream that can resume: ``text/event-stream`` with ``X-Sluice-Stream-Id`` on a request that
asked for ``X-Sluice-Resumable: true``, or a read of ``/v1/streams/{id}/events``. When that
body ends before its terminal frame (a reset, a gateway killed or drained, a proxy's cut),
the transport asks ``GET /v1/streams/{id}/events`` with the ``Last-Event-ID`` of the last
whole frame it passed on, the stream's resume token (``X-Sluice-Resume-Token``) and the
first request's credentials, and goes on passing the server's bytes: nothing missing,
nothing twice. ``204`` (nothing after that id) ends the body cleanly.

Rules (:class:`ResumeCursor`, sans-IO, tested byte at a time):

1. Only whole frames pass (WHATWG HTML §9.2.6: an event is dispatched at its blank line);
   the bytes of a frame cut mid-way are dropped and come again on the resumed connection.
   Comment lines at a frame's start (``: ping``) pass at once, so a heartbeat reaches the
   client when it is sent.
2. A body that ends cleanly after a terminal frame is over: native ``done``/``error``,
   Anthropic ``message_stop``/``error``, Responses ``response.completed``/``failed``/
   ``incomplete``, or ``data: [DONE]``. Any other end, clean or not, resumes; the
   server's ``204`` then says the stream was already over (an in-band OpenAI error frame
   has no terminator, so one more request finds that out).
3. Reconnections wait as EventSource does: ``retry:`` when the server sent one, else
   :attr:`ResumeSettings.initial_delay_s`, doubled per failure up to ``max_delay_s``;
   ``Retry-After`` of a ``429``/``503`` is honoured. After ``max_attempts`` reconnections
   in a row without a new frame, or any other refusal (``410`` ``resume_gap``, ``404``,
   ``401``), the body raises :class:`ResumeError`, which SDKs see as a connection error.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import anyio
import httpx2

from sluice.errors import ConfigError
from sluice.sse import DEFAULT_MAX_EVENT_CHARS, Decoder, Event

__all__ = [
    "MAX_FRAME_BYTES",
    "AsyncResumingTransport",
    "ResumeCursor",
    "ResumeError",
    "ResumeSettings",
    "ResumingTransport",
]

_STREAM_ID_HEADER = "x-sluice-stream-id"
_RESUMABLE_HEADER = "x-sluice-resumable"
_TOKEN_HEADER = "x-sluice-resume-token"
# Credentials of the first request that the resumed read carries too.
_CREDENTIAL_HEADERS = ("authorization", "x-api-key")
_EVENTS_PATH = re.compile(r"^(?P<prefix>.*)/v1/streams/(?P<id>[^/]+)/events$")
_API_PATH = re.compile(r"^(?P<prefix>.*)/v1/")
_TERMINAL_EVENTS = frozenset(
    {
        "done",
        "error",
        "message_stop",
        "response.completed",
        "response.failed",
        "response.incomplete",
    }
)
_RETRY_STATUSES = frozenset({429, 502, 503, 504})
# A line terminator (§9.2.5: CRLF, LF or CR); a CR at the end of a chunk may be half a CRLF.
_LINE_END = re.compile(rb"\r\n|\r|\n")
# The most a frame may hold before its blank line (the decoder's own event bound, in bytes).
MAX_FRAME_BYTES = 4 * DEFAULT_MAX_EVENT_CHARS


class ResumeError(httpx2.TransportError):
    """A resumable stream could not be resumed (refused, or the server stayed away).

    Outside :mod:`sluice.errors` on purpose: it is raised inside an ``httpx2`` client's
    body, whose callers (the SDKs) catch ``httpx2.TransportError``."""


@dataclass(frozen=True, slots=True)
class ResumeSettings:
    """How hard to try: ``max_attempts`` reconnections in a row without a new frame, the
    first after ``initial_delay_s`` (or the server's ``retry:``), doubling to ``max_delay_s``."""

    max_attempts: int = 20
    initial_delay_s: float = 0.1
    max_delay_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, not {self.max_attempts}")
        if not 0 <= self.initial_delay_s <= self.max_delay_s:
            raise ConfigError(
                f"need 0 <= initial_delay_s <= max_delay_s, got {self.initial_delay_s}, "
                f"{self.max_delay_s}"
            )


def _is_terminal(event: Event) -> bool:
    return event.event in _TERMINAL_EVENTS or event.data == "[DONE]"


def _retry_after_s(response: httpx2.Response) -> float | None:
    try:
        return float(response.headers.get("retry-after", ""))
    except ValueError:
        return None


class ResumeCursor:
    """Where one resumable stream's body is: the whole frames passed on, the last event id,
    whether its terminal frame came, and the next request to ask for the rest. No I/O."""

    def __init__(
        self, request: httpx2.Request, response: httpx2.Response, settings: ResumeSettings
    ) -> None:
        self._settings = settings
        self._decoder = Decoder()
        self._pending = b""  # the start of a frame not yet whole
        self._num_failures = 0  # reconnections in a row without a new frame
        self._delay_s = 0.0
        self._retry_after_s: float | None = None
        self.finished = False
        path = request.url.path
        events = _EVENTS_PATH.match(path)
        if events is not None:  # a native read: resume the same URL (its ?token= included)
            self._url = request.url
        else:
            prefix = m.group("prefix") if (m := _API_PATH.match(path)) else ""
            stream_id = response.headers[_STREAM_ID_HEADER]
            self._url = request.url.copy_with(
                path=f"{prefix}/v1/streams/{stream_id}/events", query=None
            )
        self._headers = {
            name: request.headers[name] for name in _CREDENTIAL_HEADERS if name in request.headers
        }
        if (token := response.headers.get(_TOKEN_HEADER)) is not None:
            self._headers[_TOKEN_HEADER] = token
        self._headers["accept"] = "text/event-stream"

    @staticmethod
    def applies(request: httpx2.Request, response: httpx2.Response) -> bool:
        """Whether ``response`` is a Sluice stream that can resume."""
        if response.status_code != 200:
            return False
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return False
        if _EVENTS_PATH.match(request.url.path):
            return True
        asked = request.headers.get(_RESUMABLE_HEADER, "").lower() == "true"
        return asked and _STREAM_ID_HEADER in response.headers

    @property
    def last_event_id(self) -> str:
        return self._decoder.last_event_id

    def feed(self, data: bytes) -> bytes:
        """The bytes of ``data`` (after what came before) that may pass on: whole frames,
        and comment lines at a frame's start. What is held back always starts a frame."""
        buffer = self._pending + data
        # A CR at the end may be the first half of a CRLF: decide once the next byte is in.
        limit = len(buffer) - 1 if buffer.endswith(b"\r") else len(buffer)
        line_start = passed = 0
        for end in _LINE_END.finditer(buffer, 0, limit):
            line = buffer[line_start : end.start()]
            if not line or (passed == line_start and line.startswith(b":")):
                passed = end.end()  # a whole frame, or a comment before any field
            line_start = end.end()
        out, self._pending = buffer[:passed], buffer[passed:]
        if len(self._pending) > MAX_FRAME_BYTES:
            raise ResumeError(f"{self._url.path}: a frame of over {MAX_FRAME_BYTES} bytes")
        if out:
            self._num_failures = 0
            if any(_is_terminal(event) for event in self._decoder.feed(out)):
                self.finished = True
        return out

    def next_request(self) -> httpx2.Request | None:
        """After a body ended (cleanly or not): the request for the rest, or ``None`` when
        the stream is over. Raises :class:`ResumeError` after too many tries."""
        if self.finished:
            return None
        self._pending = b""  # a cut frame comes again whole
        self._num_failures += 1
        if self._num_failures > self._settings.max_attempts:
            raise ResumeError(
                f"{self._url.path}: not resumed after {self._settings.max_attempts} attempts"
            )
        retry_ms = self._decoder.retry_ms
        if self._num_failures == 1:
            self._delay_s = (
                retry_ms / 1000 if retry_ms is not None else self._settings.initial_delay_s
            )
        else:
            self._delay_s = min(max(self._delay_s * 2, 0.01), self._settings.max_delay_s)
        if self._retry_after_s is not None:  # the server's word wins
            self._delay_s, self._retry_after_s = self._retry_after_s, None
        headers = dict(self._headers)
        if self.last_event_id:
            headers["last-event-id"] = self.last_event_id
        return httpx2.Request("GET", self._url, headers=headers)

    @property
    def delay_s(self) -> float:
        """How long to wait before sending :meth:`next_request`'s request."""
        return self._delay_s

    def answered(self, response: httpx2.Response) -> bool:
        """Whether to read the resumed ``response``'s body (``200``). ``204``: the stream
        is over; ``429``/``5xx``: try again (after ``Retry-After``); any other status
        raises :class:`ResumeError`. The caller closes a body it does not read."""
        if response.status_code == 200:
            return True
        if response.status_code == 204:
            self.finished = True
            return False
        if response.status_code in _RETRY_STATUSES:
            if (after := _retry_after_s(response)) is not None:
                self._retry_after_s = min(max(after, 0.0), self._settings.max_delay_s)
            return False
        raise ResumeError(f"{self._url.path}: resume refused with {response.status_code}")


def _with_body(
    response: httpx2.Response, body: httpx2.SyncByteStream | httpx2.AsyncByteStream
) -> httpx2.Response:
    return httpx2.Response(
        response.status_code, headers=response.headers, stream=body, extensions=response.extensions
    )


class _ResumingBody(httpx2.SyncByteStream):
    def __init__(
        self, transport: httpx2.BaseTransport, cursor: ResumeCursor, first: httpx2.Response
    ) -> None:
        self._transport, self._cursor = transport, cursor
        self._response: httpx2.Response | None = first
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        cursor = self._cursor
        while (response := self._response) is not None:
            try:
                for chunk in response.iter_raw():
                    if out := cursor.feed(chunk):
                        yield out
            except httpx2.TransportError:
                pass  # ended without its terminal: resume below
            finally:
                response.close()
                self._response = None
            if not self._closed:
                self._response = self._resumed()

    def _resumed(self) -> httpx2.Response | None:
        """The response that goes on with the stream; ``None`` once it is over."""
        cursor = self._cursor
        while (request := cursor.next_request()) is not None:
            time.sleep(cursor.delay_s)  # the reconnection delay, as EventSource's
            try:
                response = self._transport.handle_request(request)
            except httpx2.TransportError:
                continue
            if cursor.answered(response):
                return response
            response.close()
        return None

    def close(self) -> None:
        self._closed = True
        if self._response is not None:
            self._response.close()
            self._response = None


class ResumingTransport(httpx2.BaseTransport):
    """An ``httpx2`` transport (wrapping ``transport``, by default ``HTTPTransport()``)
    whose resumable Sluice streams survive dropped connections (module docstring)."""

    def __init__(
        self,
        transport: httpx2.BaseTransport | None = None,
        settings: ResumeSettings | None = None,
    ) -> None:
        self._transport = transport or httpx2.HTTPTransport()
        self._settings = settings or ResumeSettings()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._transport.handle_request(request)
        if not ResumeCursor.applies(request, response):
            return response
        cursor = ResumeCursor(request, response, self._settings)
        return _with_body(response, _ResumingBody(self._transport, cursor, response))

    def close(self) -> None:
        self._transport.close()


class _AsyncResumingBody(httpx2.AsyncByteStream):
    def __init__(
        self, transport: httpx2.AsyncBaseTransport, cursor: ResumeCursor, first: httpx2.Response
    ) -> None:
        self._transport, self._cursor = transport, cursor
        self._response: httpx2.Response | None = first
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        cursor = self._cursor
        while (response := self._response) is not None:
            try:
                async for chunk in response.aiter_raw():
                    if out := cursor.feed(chunk):
                        yield out
            except httpx2.TransportError:
                pass  # ended without its terminal: resume below
            finally:
                await response.aclose()
                self._response = None
            if not self._closed:
                self._response = await self._resumed()

    async def _resumed(self) -> httpx2.Response | None:
        """The response that goes on with the stream; ``None`` once it is over."""
        cursor = self._cursor
        while (request := cursor.next_request()) is not None:
            await anyio.sleep(cursor.delay_s)  # the reconnection delay, as EventSource's
            try:
                response = await self._transport.handle_async_request(request)
            except httpx2.TransportError:
                continue
            if cursor.answered(response):
                return response
            await response.aclose()
        return None

    async def aclose(self) -> None:
        self._closed = True
        if self._response is not None:
            await self._response.aclose()
            self._response = None


class AsyncResumingTransport(httpx2.AsyncBaseTransport):
    """:class:`ResumingTransport` for ``httpx2.AsyncClient`` (``AsyncOpenAI``, ...)."""

    def __init__(
        self,
        transport: httpx2.AsyncBaseTransport | None = None,
        settings: ResumeSettings | None = None,
    ) -> None:
        self._transport = transport or httpx2.AsyncHTTPTransport()
        self._settings = settings or ResumeSettings()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._transport.handle_async_request(request)
        if not ResumeCursor.applies(request, response):
            return response
        cursor = ResumeCursor(request, response, self._settings)
        return _with_body(response, _AsyncResumingBody(self._transport, cursor, response))

    async def aclose(self) -> None:
        await self._transport.aclose()
