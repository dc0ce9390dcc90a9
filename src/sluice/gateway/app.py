"""``create_app(settings)``: the whole ASGI application.

The SSE reads (``GET /v1/streams/{id}/events``, ``GET /v1/demo/words``) are dispatched
straight to :class:`~sluice.gateway.streaming.EventStreams`; everything else goes through a
small Starlette app (routing, CORS preflight, the lifespan that runs the hub).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from importlib import resources as package_data
from typing import Protocol, runtime_checkable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice.backends.base import Backend
from sluice.backends.words import WordsBackend
from sluice.errors import SluiceError
from sluice.gateway.auth import Auth
from sluice.gateway.compat import CompatAPI
from sluice.gateway.errors import error_response, response_for
from sluice.gateway.limits import check_head
from sluice.gateway.openapi import openapi_endpoint
from sluice.gateway.routes import NativeApi
from sluice.gateway.settings import Settings
from sluice.gateway.streaming import EventStreams
from sluice.observability.metrics import Metrics
from sluice.streams.hub import StreamHub
from sluice.streams.log import LogLimits
from sluice.streams.memory import MemoryEventLog
from sluice.transports.asgi import Receive, Scope, Send

__all__ = ["SluiceApp", "create_app"]


@runtime_checkable
class _AbortObserved(Protocol):
    """A backend that reports how long its aborts take to free resources (the engine)."""

    def set_abort_observer(self, observer: Callable[[float], None] | None) -> None: ...


class SluiceApp:
    """The ASGI callable; ``hub`` is exposed for operations and tests."""

    def __init__(
        self,
        settings: Settings,
        backends: Mapping[str, Backend],
        resources: Sequence[contextlib.AbstractAsyncContextManager[object]] = (),
        auth: Auth | None = None,
    ) -> None:
        self.settings = settings
        self.auth = auth or Auth.anonymous()
        self._resources = tuple(resources)
        log = MemoryEventLog(LogLimits(settings.max_log_records, settings.max_log_bytes))
        # Per-tenant limits default to the server's when there is one tenant (no keys).
        hub_settings = settings.hub_settings(multi_tenant=self.auth.num_keys > 0)
        versions = {name: str(getattr(b, "version", "")) for name, b in backends.items()}
        self.metrics = Metrics(versions)
        for name, backend in backends.items():
            if isinstance(backend, _AbortObserved):
                backend.set_abort_observer(functools.partial(self.metrics.abort_freed, name))
        self.hub = StreamHub(log, backends, hub_settings, observer=self.metrics)
        self.metrics.log_bytes.set_function(lambda: self.hub.memory.num_bytes)
        self.streams = EventStreams(self.hub, settings, self.metrics, self.auth)
        page = package_data.files("sluice.web").joinpath("index.html").read_text("utf-8")
        api = NativeApi(self.hub, settings, page, self.metrics, self.auth)
        compat = CompatAPI(self.hub, settings, self.streams.options, self.metrics, self.auth)
        self._framework = Starlette(
            routes=[
                Route("/", api.page, methods=["GET"]),
                Route("/healthz", api.healthz, methods=["GET"]),
                Route("/readyz", api.readyz, methods=["GET"]),
                Route("/metrics", api.metrics, methods=["GET"]),
                Route("/openapi.json", openapi_endpoint(settings), methods=["GET"]),
                Route("/v1/models", api.models, methods=["GET"]),
                Route("/v1/streams", api.create_stream, methods=["POST"]),
                Route("/v1/streams/{stream_id}", api.get_stream, methods=["GET"]),
                Route("/v1/streams/{stream_id}/cancel", api.cancel_stream, methods=["POST"]),
                Route("/v1/streams/{stream_id}/drop", api.drop_connections, methods=["POST"]),
                Route("/v1/streams/{stream_id}/events", _method_not_allowed, methods=["GET"]),
                Route("/v1/demo/words", _method_not_allowed, methods=["GET"]),
                Route("/v1/chat/completions", compat.chat_completions, methods=["POST"]),
                Route("/v1/completions", compat.completions, methods=["POST"]),
                Route("/v1/messages", compat.messages, methods=["POST"]),
            ],
            middleware=[
                Middleware(
                    CORSMiddleware,
                    allow_origins=list(settings.cors_allow_origins),
                    allow_methods=["GET", "POST", "OPTIONS"],
                    allow_headers=[
                        "Last-Event-ID",
                        "Content-Type",
                        "Authorization",
                        "X-Sluice-Resumable",
                        "X-API-Key",
                        "Anthropic-Version",
                    ],
                    expose_headers=["X-Sluice-Stream-Id", "X-Sluice-Resume-Token"],
                    max_age=600,
                ),
            ],
            exception_handlers={HTTPException: _http_error},
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # Resources (an engine's driver thread) start before the hub and stop after it, so
        # the hub's last cancellations still reach them.
        async with contextlib.AsyncExitStack() as stack:
            for resource in self._resources:
                await stack.enter_async_context(resource)
            async with self.hub.running():
                yield
            for backend in set(self.hub.backends.values()):
                await backend.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                check_head(scope, self.settings)
            except SluiceError as exc:
                await response_for(exc)(scope, receive, send)
                return
            if EventStreams.handles(scope["method"], scope["path"]):
                await self.streams(scope, receive, send)
                return
        await self._framework(scope, receive, send)


async def _method_not_allowed(request: Request) -> Response:  # pragma: no cover - GETs go fast
    return error_response(405, "method_not_allowed", "use GET")


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal server error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
    return error_response(status, code, str(detail))


def create_app(
    settings: Settings | None = None,
    backends: Mapping[str, Backend] | None = None,
    resources: Sequence[contextlib.AbstractAsyncContextManager[object]] = (),
    auth: Auth | None = None,
) -> SluiceApp:
    """Build the app; ``backends`` come first in ``/v1/models``, then ``words``, always served.

    ``resources`` are entered for the app's lifetime, before the hub starts (for example
    the driver thread of an embedded engine). ``auth`` holds the API keys and the resume
    token secret; without it every caller is tenant ``"anonymous"``.
    """
    settings = settings or Settings()
    served: dict[str, Backend] = {**(backends or {})}
    served.setdefault("words", WordsBackend())
    return SluiceApp(settings, served, resources, auth)
