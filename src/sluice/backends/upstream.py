"""The ``upstream`` backend: generations proxied from an OpenAI-compatible server.

vLLM, TGI, llama.cpp, Ollama and OpenAI itself all stream ``POST /chat/completions`` and
``POST /completions`` as server-sent events of JSON chunks ending in ``data: [DONE]``.
:class:`UpstreamBackend` owns one ``httpx.AsyncClient`` (its connection pool) for one such
server; each :class:`UpstreamGeneration` is one streamed request (its body built by
:mod:`sluice.backends.upstream_body`, tools included), sent when iteration starts
(``start()``, or the first iteration) and read with our own bounded SSE decoder
(:class:`sluice.sse.Decoder`). ``start()`` returns once the response head is in, so a
refusal (a status, a refused connection) is raised there and can become an HTTP status.

Reading. What one network chunk completes is decoded and handed to a
:class:`~sluice.backends.openai_stream.ChunkReader`, which turns the chunks into one
:class:`Delta` and keeps the usage (for :meth:`usage`) and finish reason; that module says
how fields and finish reasons are read.

Errors, translated at this boundary (``raise ... from`` the httpx or decoder error); every
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
cancelled task all close the response before its body was read, which makes httpx close
the connection instead of pooling it: the upstream sees the disconnect and frees its slot,
and no half-read connection is ever reused. After ``[DONE]`` the rest of the body (the
chunked terminator) is drained for up to ``_DRAIN_AFTER_DONE_S`` so that the connection
goes back to the pool. ``trust_env`` is off: proxies and certificates come from arguments,
never from the environment.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Final, cast

import anyio
import httpx
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


@dataclass(frozen=True, slots=True)
class _Upstream:
    """What every generation of one backend shares."""

    client: httpx.AsyncClient
    api_key: str | None
    connect_timeout_s: float
    read_timeout_s: float
    max_line_bytes: int
    max_event_chars: int

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
        self._response: httpx.Response | None = None
        self._send_scope: anyio.CancelScope | None = None

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
            await self._response.aclose()  # unread body: httpx closes the connection

    def usage(self) -> Usage:
        if self._reader.usage is not None:
            return self._reader.usage
        return Usage(prompt_tokens=0, completion_tokens=self._reader.num_events)

    def _abort_requested(self) -> bool:
        return self._aborted

    async def _run(self) -> AsyncIterator[Delta]:
        await self.start()
        response = self._response
        if response is None or response.is_closed:  # aborted, or start() failed
            return
        chunks = cast(AsyncGenerator[bytes, None], response.aiter_bytes())
        decoder = Decoder(
            max_line_bytes=self._upstream.max_line_bytes,
            max_event_chars=self._upstream.max_event_chars,
        )
        try:
            while not self._reader.done:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except httpx.HTTPError as exc:
                    if self._aborted or self._reader.finish_reason is not None:
                        return  # aborted, or the generation had finished anyway
                    raise self._body_error(exc) from exc
                if self._abort_requested():
                    return
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
            await _drain(chunks)
        finally:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()
                await response.aclose()

    async def _open(self) -> None:
        """Send the request; ``self._response`` is then the streaming response, unless an
        abort came first."""
        client = self._upstream.client
        if client.is_closed:
            raise BackendError(f"the backend for upstream {self._url} is closed")
        request = client.build_request(
            "POST", self._url, content=self._body, headers={"content-type": "application/json"}
        )
        response: httpx.Response | None = None
        with anyio.CancelScope() as scope:
            self._send_scope = scope
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise self._send_error(exc) from exc
            finally:
                self._send_scope = None
        if response is None:  # abort() cancelled the scope
            return
        self._response = response
        if self._abort_requested():
            await response.aclose()
            return
        if not response.is_success:
            raise await self._status_error(response)
        media_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type == "application/json":
            await response.aclose()
            raise BackendError(
                f"upstream {self._url} answered with JSON, not an event stream "
                "(does it support stream: true?)"
            )

    def _delta(self, decoder: Decoder, data: bytes) -> Delta | None:
        """Everything one network chunk completed, as one delta (``None`` if nothing)."""
        try:
            sse_events = decoder.feed(data)
        except SSEDecodeError as exc:
            raise BackendError(
                f"upstream {self._url} sent a malformed event stream: {exc}"
            ) from exc
        return self._reader.read(sse_event.data for sse_event in sse_events)

    async def _status_error(self, response: httpx.Response) -> SluiceError:
        """The error for a non-2xx answer, with the upstream's (bounded) message."""
        body = bytearray()
        try:
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > _MAX_ERROR_BODY_BYTES:
                    break
        except httpx.HTTPError:
            pass  # the status says enough; quote what arrived
        finally:
            await response.aclose()
        status = response.status_code
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

    def _send_error(self, exc: httpx.HTTPError) -> SluiceError:
        """The error for a request that got no response head."""
        url = self._url
        if isinstance(exc, httpx.PoolTimeout):
            return CapacityError(
                f"every connection to upstream {url} is busy",
                retry_after_s=_DEFAULT_RETRY_AFTER_S,
            )
        if isinstance(exc, httpx.ConnectTimeout):
            return BackendError(
                f"upstream {url} did not accept a connection within "
                f"{self._upstream.connect_timeout_s} s",
                retryable=True,
            )
        if isinstance(exc, httpx.ConnectError):
            return BackendError(f"cannot connect to upstream {url}: {exc}", retryable=True)
        return self._body_error(exc)

    def _body_error(self, exc: httpx.HTTPError) -> BackendError:
        """The error for a transport failure once the request was sent."""
        url = self._url
        if isinstance(exc, httpx.ReadTimeout):
            return BackendError(
                f"upstream {url} sent nothing for {self._upstream.read_timeout_s} s",
                retryable=True,
            )
        if isinstance(exc, httpx.NetworkError | httpx.TimeoutException | httpx.RemoteProtocolError):
            return BackendError(
                f"upstream {url} closed the stream before it finished ({type(exc).__name__})",
                retryable=True,
            )
        return BackendError(f"request to upstream {url} failed: {type(exc).__name__}: {exc}")


async def _drain(chunks: AsyncGenerator[bytes, None]) -> None:
    """Read what follows ``[DONE]`` (the chunked terminator), briefly and boundedly."""
    num_bytes = 0
    with anyio.move_on_after(_DRAIN_AFTER_DONE_S):
        try:
            async for chunk in chunks:
                num_bytes += len(chunk)
                if num_bytes > _MAX_DRAIN_BYTES:
                    return  # not a terminator: the connection is closed, not pooled
        except httpx.HTTPError:
            return


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
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
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
        headers = {"accept": "text/event-stream", "accept-encoding": "identity"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(
                connect=connect_timeout_s,
                read=read_timeout_s,
                write=read_timeout_s,
                pool=connect_timeout_s,
            ),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            follow_redirects=False,
            trust_env=False,
        )
        self._upstream = _Upstream(
            client=client,
            api_key=api_key or None,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
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
        await self._upstream.client.aclose()
