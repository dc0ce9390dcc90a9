"""What the gateway hands the native HTTP/1.1 path: the opener of ``sluice serve``.

The transport (:mod:`sluice.transports.http1`) parses, bounds and times requests and
writes answers; it imports nothing of the gateway. :class:`GatewayOpener` implements its
:class:`~sluice.transports.http1.opener.Opener`: it routes to the native path the SSE
reads (:class:`~sluice.gateway.streaming.EventStreams`) and every compatible API's
``POST`` (:class:`~sluice.gateway.compat.CompatAPI`, the same handler the ASGI routes
run), and words the transport's own refusals in the gateway's shapes. A route on this path
does what the ASGI app would do around it: it checks the ``Host`` and adds the CORS
headers (the SSE reads do both themselves).
"""

from __future__ import annotations

import dataclasses

from sluice.dialects.base import ApiDialect
from sluice.dialects.registry import API_DIALECTS
from sluice.errors import CapacityError, SluiceError
from sluice.gateway.compat import CompatAPI
from sluice.gateway.cors import CorsPolicy
from sluice.gateway.errors import (
    HeadersTooLargeError,
    PayloadTooLargeError,
    UrlTooLongError,
    error_response,
    response_for,
)
from sluice.gateway.hosts import HostPolicy
from sluice.gateway.requests import stamp_received
from sluice.gateway.settings import Settings
from sluice.gateway.streaming import EventStreams, refusal, whole_response
from sluice.observability.metrics import Metrics
from sluice.transports.answer import Answer, Whole
from sluice.transports.asgi import Scope
from sluice.transports.delivery import DeliveryOptions
from sluice.transports.http1.opener import BodySource, Http1Limits, Refusal, Route
from sluice.transports.http1.write_batch import WriteBatch

__all__ = ["GatewayOpener"]

# What a request refused for the connection limit is told to wait (``Retry-After``).
_CONNECTION_LIMIT_RETRY_AFTER_S = 1.0


class _EventsRoute:
    """The SSE reads: ``GET /v1/streams/{id}/events``, ``GET /v1/demo/words``."""

    __slots__ = ("_streams",)

    takes_body = False

    def __init__(self, streams: EventStreams) -> None:
        self._streams = streams

    async def answer(self, scope: Scope, body: BodySource) -> Answer:
        return await self._streams.open(scope)


class _CompatRoute:
    """One compatible API's ``POST``."""

    __slots__ = ("_compat", "_cors", "_hosts", "_speaker")

    takes_body = True

    def __init__(
        self, compat: CompatAPI, speaker: ApiDialect, cors: CorsPolicy, hosts: HostPolicy
    ) -> None:
        self._compat = compat
        self._speaker = speaker
        self._cors = cors
        self._hosts = hosts

    async def answer(self, scope: Scope, body: BodySource) -> Answer:
        try:
            self._hosts.check(scope)  # as the app does before any route
        except SluiceError as exc:
            return whole_response(response_for(exc))

        async def read(max_bytes: int) -> bytes:
            data = await body(max_bytes)
            if len(data) > max_bytes:
                raise PayloadTooLargeError(f"request body over {max_bytes} bytes")
            return data

        answer = await self._compat.answer(self._speaker, scope, read)
        extra = self._cors.response_headers(scope["headers"])  # as CorsMiddleware adds them
        if not extra:
            return answer
        return dataclasses.replace(answer, headers=(*answer.headers, *extra))


class GatewayOpener:
    """The native path's :class:`~sluice.transports.http1.opener.Opener` for one app."""

    def __init__(
        self,
        settings: Settings,
        streams: EventStreams,
        compat: CompatAPI,
        metrics: Metrics,
        *,
        cors: CorsPolicy,
        hosts: HostPolicy,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._events = _EventsRoute(streams)
        self._compat: dict[str, Route] = {
            speaker.path: _CompatRoute(compat, speaker, cors, hosts) for speaker in API_DIALECTS
        }
        self._delivery = streams.options
        self._limits = settings.http
        self._writes = WriteBatch()

    @property
    def limits(self) -> Http1Limits:
        return self._limits

    @property
    def delivery(self) -> DeliveryOptions:
        return self._delivery

    @property
    def writes(self) -> WriteBatch:
        return self._writes

    def began(self, scope: Scope) -> None:
        stamp_received(scope)

    def route(self, method: str, path: str) -> Route | None:
        if EventStreams.handles(method, path):
            return self._events
        if method == "POST":
            return self._compat.get(path)
        return None

    def refusal(self, reason: Refusal, method: str | None, path: str | None) -> Whole:
        limits = self._settings.http
        if reason is Refusal.URL_TOO_LONG:
            return refusal(UrlTooLongError(f"request target over {limits.max_url_bytes} bytes"))
        if reason is Refusal.HEADERS_TOO_LARGE:
            message = f"request header lines over {limits.max_header_bytes} bytes"
            return refusal(HeadersTooLargeError(message))
        if reason is Refusal.TOO_MANY_CONNECTIONS:
            self._metrics.refusals.labels("max_connections").inc()
            error = CapacityError(
                "too many open connections; retry later",
                retry_after_s=_CONNECTION_LIMIT_RETRY_AFTER_S,
                reason="max_connections",
            )
            if method is not None and path is not None and EventStreams.handles(method, path):
                return refusal(error)  # a retry: hint, so EventSource comes back
            return whole_response(response_for(error))
        if reason is Refusal.HEAD_TIMEOUT:
            message = f"request head not received within {limits.head_timeout_s:g} s"
        else:
            message = f"request body not received within {limits.body_timeout_s:g} s"
        return whole_response(error_response(408, "request_timeout", message))
