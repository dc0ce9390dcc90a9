"""The ``upstream`` backend: generations proxied from an OpenAI-compatible server.

vLLM, TGI, llama.cpp, Ollama and OpenAI itself all stream ``POST /chat/completions`` and
``POST /completions`` as server-sent events of JSON chunks ending in ``data: [DONE]``.
:class:`UpstreamBackend` owns one ``aiohttp.ClientSession`` (its connection pool) for one
such server; each :class:`UpstreamGeneration` is one streamed request (its body built by
:mod:`sluice.backends.upstream_body`, tools included), sent when iteration starts
(``start()``, or the first iteration) and read with our own bounded SSE decoder
(:class:`sluice.sse.Decoder`). ``start()`` returns once the response head is in, so a
refusal (a status, a refused connection) is raised there and can become an HTTP status.

Reading. What one HTTP chunk (or, unchunked, one network read) completes is decoded and handed to a
:class:`~sluice.backends.openai_stream.ChunkReader`, which turns the chunks into one
:class:`Delta` and keeps the usage (for :meth:`usage`) and finish reason; that module says
how fields and finish reasons are read.

Errors, translated at this boundary (``raise ... from`` the aiohttp or decoder error); every
message names the upstream URL and never the API key (upstream text is redacted):

- status 400/404/409/413/422 -> :class:`~sluice.errors.BadRequestError` with the
  upstream's message; 401/403 -> :class:`~sluice.errors.BackendError` (credentials, not
  retryable); 429/503 -> :class:`~sluice.errors.CapacityError` (``Retry-After``, default
  1 s); 408 and other 5xx -> retryable ``BackendError``; anything else -> ``BackendError``;
- no free pooled connection within ``connect_timeout_s`` -> ``CapacityError``; connect
  error, connect or read timeout -> retryable ``BackendError``;
- malformed SSE, non-JSON data, chunks without the expected fields, a ``200`` answered
  with JSON instead of a stream -> ``BackendError``; in-band ``{"error": ...}`` ->
  ``BackendError`` with its message (retryable when its ``code`` is 429, 503 or 5xx);
- the stream ending before ``[DONE]`` and before any finish reason -> retryable
  ``BackendError``; after a finish reason it ends normally.

Connections. :meth:`UpstreamGeneration.abort`, a consumer that stops iterating and a
cancelled task all close the response before its body was read, which closes the
connection instead of pooling it: the upstream sees the disconnect and frees its slot,
and no half-read connection is ever reused. After ``[DONE]`` the rest of the body (the
chunked terminator) is drained for up to ``_DRAIN_AFTER_DONE_S`` so that the connection
goes back to the pool. ``trust_env`` is off: proxies and certificates come from arguments,
never from the environment.

Why aiohttp and not httpx (which the rest of the project uses as a client): this read is
the proxy's hot path, one network read per token, and httpx's pure-Python stack
(httpcore, h11, anyio timeouts) cost about 65 us of CPU per read here against about 10 us
for aiohttp's C parser, measured with 32 streams of one chunk per millisecond each.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Final

import aiohttp
import anyio
import orjson

from sluice.backends.base import Delta, GenerationRequest
from sluice.backends.openai_stream import CAPACITY_STATUSES, ChunkReader, message_of
from sluice.backends.upstream_body import request_body
from sluice.errors import (
    BackendError,
    BadRequestError,
    CapacityError,
    ConfigError,
    SluiceError,
    SSEDecodeError,
)
from sluice.events import Usage
from sluice.sse import DEFAULT_MAX_EVENT_CHARS, DEFAULT_MAX_LINE_BYTES, Decoder

__all__ = ["UpstreamBackend", "UpstreamGeneration"]

# Seconds a client is asked to wait after a 429/503 without a usable Retry-After, and after
# finding every pooled connection busy.
_DEFAULT_RETRY_AFTER_S: Final = 1.0
# A Retry-After of more digits (over 31 years) is nonsense; the default is used instead.
_MAX_RETRY_AFTER_DIGITS: Final = 9
# An error body is a short JSON object or a line of text; beyond this nothing is read.
_MAX_ERROR_BODY_BYTES: Final = 64 << 10
# Upstream text quoted in our messages (error messages, bad chunks) is cut to this length.
_MAX_QUOTED_CHARS: Final = 500
# After [DONE] only the chunked terminator should follow; draining it returns the
# connection to the pool. A stuck upstream costs at most this long, then the connection is
# closed instead.
_DRAIN_AFTER_DONE_S: Final = 1.0
_MAX_DRAIN_BYTES: Final = 64 << 10

_BAD_REQUEST_STATUSES: Final = frozenset({400, 404, 409, 413, 422})
_CREDENTIAL_STATUSES: Final = frozenset({401, 403})


class _Upstream:
    """What every generation of one backend shares: the connection pool (an
    ``aiohttp.ClientSession``, made in the event loop on first use) and its slots."""

    __slots__ = (
        "_closed",
        "_connector_limit",
        "_headers",
        "_session",
        "_timeout",
        "api_key",
        "connect_timeout_s",
        "max_event_chars",
        "max_line_bytes",
        "read_timeout_s",
        "slots",
    )

    def __init__(
        self,
        *,
        headers: dict[str, str],
        api_key: str | None,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int,
        max_line_bytes: int,
        max_event_chars: int,
    ) -> None:
        self._headers = headers
        self.api_key = api_key
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_line_bytes = max_line_bytes
        self.max_event_chars = max_event_chars
        self._connector_limit = max_connections
        # Connect covers the TCP (and TLS) handshake; sock_read every read, the head's too.
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=read_timeout_s
        )
        # Waiting for a free connection is bounded apart from connecting, so that a full
        # pool is a CapacityError and not a connect timeout.
        self.slots = asyncio.Semaphore(max_connections)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._connector_limit, limit_per_host=0),
                headers=self._headers,
                timeout=self._timeout,
                auto_decompress=False,
                trust_env=False,
            )
        return self._session

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()

    def quote(self, text: str) -> str:
        """Upstream text made safe to put in a message: key redacted, length bounded."""
        if self.api_key:
            text = text.replace(self.api_key, "<api key>")
        return text if len(text) <= _MAX_QUOTED_CHARS else text[:_MAX_QUOTED_CHARS] + "..."


class UpstreamGeneration:
    """One streamed upstream request, sent by ``start()`` (or the first iteration);
    iterable once."""

    __slots__ = (
        "_aborted",
        "_body",
        "_iterated",
        "_reader",
        "_response",
        "_send_scope",
        "_sent",
        "_slot",
        "_upstream",
        "_url",
    )

    def __init__(self, upstream: _Upstream, url: str, body: bytes, *, chat: bool) -> None:
        self._upstream = upstream
        self._url = url
        self._body = body
        self._sent = False
        self._iterated = False
        self._aborted = False
        self._reader = ChunkReader(url=url, chat=chat, quote=upstream.quote)
        self._response: aiohttp.ClientResponse | None = None
        self._send_scope: anyio.CancelScope | None = None
        self._slot = False  # holds one of the pool's connection slots

    async def start(self) -> None:
        """Send the request and read the response head (once; nothing after an abort).

        Raises the error for a refusal: a status, a refused connection, a timeout.
        """
        if self._sent or self._aborted:
            return
        self._sent = True
        await self._open()

    def __aiter__(self) -> AsyncIterator[Delta]:
        if self._iterated:
            raise RuntimeError("an UpstreamGeneration can be iterated only once")
        self._iterated = True
        return self._run()

    async def abort(self) -> None:
        """Close the upstream request and its connection (idempotent, safe in every state)."""
        self._aborted = True
        if self._send_scope is not None:  # connecting or waiting for the response head
            self._send_scope.cancel()
        if self._response is not None:
            self._close()  # unread body: the connection is closed, never pooled

    def usage(self) -> Usage:
        if self._reader.usage is not None:
            return self._reader.usage
        return Usage(prompt_tokens=0, completion_tokens=self._reader.num_events)

    def _abort_requested(self) -> bool:
        return self._aborted

    async def _run(self) -> AsyncIterator[Delta]:
        try:
            await self.start()
            response = self._response
            if response is None:  # aborted, or start() failed
                return
            content = response.content
            decoder = Decoder(
                max_line_bytes=self._upstream.max_line_bytes,
                max_event_chars=self._upstream.max_event_chars,
            )
            while not self._reader.done:
                try:
                    chunk, _ = await content.readchunk()  # up to an HTTP chunk's end
                except (aiohttp.ClientError, TimeoutError) as exc:
                    if self._aborted or self._reader.finish_reason is not None:
                        return  # aborted, or the generation had finished anyway
                    raise self._body_error(exc) from exc
                if self._abort_requested():
                    return
                if not chunk:  # the end of the body
                    break
                delta = self._delta(decoder, chunk)
                if delta is not None:
                    yield delta
                    if self._abort_requested():  # abort() ran while the consumer held it
                        return
            if not self._reader.done:
                if self._reader.finish_reason is None:
                    raise BackendError(
                        f"upstream {self._url} closed the stream before it finished",
                        retryable=True,
                    )
                return
            if await _drained(content):
                response.release()  # read to its end: the connection goes back to the pool
        finally:
            self._close()

    def _close(self) -> None:
        """Close the response unless it was released, and give back the pool slot."""
        if self._response is not None:
            self._response.close()  # after release(), only marks it closed
            self._response = None
        if self._slot:
            self._slot = False
            self._upstream.slots.release()

    async def _open(self) -> None:
        """Send the request; ``self._response`` is then the streaming response, unless an
        abort came first."""
        upstream = self._upstream
        if upstream.closed:
            raise BackendError(f"the backend for upstream {self._url} is closed")
        response: aiohttp.ClientResponse | None = None
        with anyio.CancelScope() as scope:
            self._send_scope = scope
            try:
                await self._take_slot()
                response = await upstream.session().post(
                    self._url, data=self._body, allow_redirects=False
                )
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._close()
                raise self._send_error(exc) from exc
            finally:
                self._send_scope = None
        if response is None:  # abort() cancelled the scope
            self._close()
            return
        self._response = response
        if self._abort_requested():
            self._close()
            return
        if not 200 <= response.status < 300:
            raise await self._status_error(response)
        if response.content_type == "application/json":
            self._close()
            raise BackendError(
                f"upstream {self._url} answered with JSON, not an event stream "
                "(does it support stream: true?)"
            )

    async def _take_slot(self) -> None:
        """One of the pool's ``max_connections`` slots, or CapacityError after waiting
        ``connect_timeout_s`` for one."""
        upstream = self._upstream
        try:
            async with asyncio.timeout(upstream.connect_timeout_s):
                await upstream.slots.acquire()
        except TimeoutError:
            raise CapacityError(
                f"every connection to upstream {self._url} is busy",
                retry_after_s=_DEFAULT_RETRY_AFTER_S,
            ) from None
        self._slot = True

    def _delta(self, decoder: Decoder, data: bytes) -> Delta | None:
        """Everything one network chunk completed, as one delta (``None`` if nothing)."""
        try:
            sse_events = decoder.feed(data)
        except SSEDecodeError as exc:
            raise BackendError(
                f"upstream {self._url} sent a malformed event stream: {exc}"
            ) from exc
        return self._reader.read(sse_event.data for sse_event in sse_events)

    async def _status_error(self, response: aiohttp.ClientResponse) -> SluiceError:
        """The error for a non-2xx answer, with the upstream's (bounded) message."""
        body = bytearray()
        try:
            while len(body) <= _MAX_ERROR_BODY_BYTES:
                chunk = await response.content.readany()
                if not chunk:
                    break
                body += chunk
        except (aiohttp.ClientError, TimeoutError):
            pass  # the status says enough; quote what arrived
        finally:
            self._close()
        status = response.status
        message = self._upstream.quote(_error_message(bytes(body[:_MAX_ERROR_BODY_BYTES])))
        url = self._url
        if status in _BAD_REQUEST_STATUSES:
            return BadRequestError(f"upstream {url} rejected the request ({status}): {message}")
        if status in _CREDENTIAL_STATUSES:
            return BackendError(f"upstream {url} refused our credentials ({status}): {message}")
        if status in CAPACITY_STATUSES:
            return CapacityError(
                f"upstream {url} is over capacity ({status}): {message}",
                retry_after_s=_retry_after_s(response.headers.get("retry-after")),
            )
        retryable = status == 408 or status >= 500
        return BackendError(f"upstream {url} answered {status}: {message}", retryable=retryable)

    def _send_error(self, exc: aiohttp.ClientError | TimeoutError) -> SluiceError:
        """The error for a request that got no response head."""
        url = self._url
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return BackendError(
                f"upstream {url} did not accept a connection within "
                f"{self._upstream.connect_timeout_s} s",
                retryable=True,
            )
        if isinstance(exc, aiohttp.ClientConnectorError):
            return BackendError(f"cannot connect to upstream {url}: {exc}", retryable=True)
        return self._body_error(exc)

    def _body_error(self, exc: aiohttp.ClientError | TimeoutError) -> BackendError:
        """The error for a transport failure once the request was sent."""
        url = self._url
        if isinstance(exc, TimeoutError):  # aiohttp's socket read timeout is one
            return BackendError(
                f"upstream {url} sent nothing for {self._upstream.read_timeout_s} s",
                retryable=True,
            )
        if isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError):
            return BackendError(
                f"upstream {url} closed the stream before it finished ({type(exc).__name__})",
                retryable=True,
            )
        return BackendError(f"request to upstream {url} failed: {type(exc).__name__}: {exc}")


async def _drained(content: aiohttp.StreamReader) -> bool:
    """Read what follows ``[DONE]`` (the chunked terminator), briefly and boundedly; True
    when the body ended, so that its connection can be pooled."""
    num_bytes = 0
    try:
        async with asyncio.timeout(_DRAIN_AFTER_DONE_S):
            while chunk := await content.readany():
                num_bytes += len(chunk)
                if num_bytes > _MAX_DRAIN_BYTES:
                    return False  # not a terminator: the connection is closed, not pooled
    except (aiohttp.ClientError, TimeoutError):
        return False
    return True


def _error_message(body: bytes) -> str:
    try:
        message = message_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        message = None
    if message is None:
        message = body.decode("utf-8", "replace").strip() or "(no message)"
    return message


def _retry_after_s(value: str | None) -> float:
    """``Retry-After`` (RFC 9110 §10.2.3): delta-seconds or an HTTP-date; else the default."""
    if value is None:
        return _DEFAULT_RETRY_AFTER_S
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value) if len(value) <= _MAX_RETRY_AFTER_DIGITS else _DEFAULT_RETRY_AFTER_S
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return _DEFAULT_RETRY_AFTER_S
    if when.tzinfo is None:
        return _DEFAULT_RETRY_AFTER_S
    return max(0.0, when.timestamp() - time.time())


class UpstreamBackend:
    """Serves ``model`` from an OpenAI-compatible server at ``base_url`` (``.../v1``).

    ``upstream_model`` is the name sent upstream (default ``model``). ``max_line_bytes``
    and ``max_event_chars`` bound the SSE decoder. Call :meth:`aclose` to close the pool.
    """

    def __init__(
        self,
        model: str,
        base_url: str,
        *,
        api_key: str | None = None,
        upstream_model: str | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_connections: int = 256,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_event_chars: int = DEFAULT_MAX_EVENT_CHARS,
    ) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"upstream base_url must be an http(s) URL, not {base_url!r}")
        if api_key is not None and not (api_key.isascii() and api_key.isprintable()):
            raise ConfigError("upstream api_key must be printable ASCII")  # never quote it
        for name, seconds in (
            ("connect_timeout_s", connect_timeout_s),
            ("read_timeout_s", read_timeout_s),
        ):
            if not seconds > 0:
                raise ConfigError(f"{name} must be positive, not {seconds}")
        if max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, not {max_connections}")
        Decoder(max_line_bytes=max_line_bytes, max_event_chars=max_event_chars)  # validates
        self._model = model
        self._upstream_model = upstream_model or model
        base = base_url.rstrip("/")
        self._chat_url = f"{base}/chat/completions"
        self._completions_url = f"{base}/completions"
        headers = {
            "accept": "text/event-stream",
            "accept-encoding": "identity",
            "content-type": "application/json",
        }
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._upstream = _Upstream(
            headers=headers,
            api_key=api_key or None,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            max_connections=max_connections,
            max_line_bytes=max_line_bytes,
            max_event_chars=max_event_chars,
        )

    @property
    def model(self) -> str:
        return self._model

    def generate(self, request: GenerationRequest) -> UpstreamGeneration:
        chat = request.messages is not None
        url = self._chat_url if chat else self._completions_url
        body = request_body(request, self._upstream_model)
        return UpstreamGeneration(self._upstream, url, body, chat=chat)

    async def aclose(self) -> None:
        """Close the connection pool (and with it any generation still reading)."""
        await self._upstream.aclose()
