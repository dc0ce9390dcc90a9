"""``create_app(settings)``: the whole ASGI application.

Every HTTP request is first checked for its head's bounds and its ``Host``
(:mod:`sluice.gateway.hosts`); CORS preflights are answered next, for every path
(:mod:`sluice.gateway.cors`). The SSE reads (``GET /v1/streams/{id}/events``,
``GET /v1/demo/words``) are then dispatched straight to
:class:`~sluice.gateway.streaming.EventStreams`; everything else goes through a small
Starlette app (routing, CORS headers, the lifespan that runs the hub).

Errors raised before a route is chosen are answered in the native (OpenAI-like) shape;
unknown paths and methods get the shape of the API they are under (Anthropic's under
``/v1/messages``), and a ``405`` names the methods the path serves in ``Allow``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from importlib import resources as package_data
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sluice.backends.base import Backend
from sluice.backends.words import WordsBackend
from sluice.dialects.registry import api_dialect
from sluice.errors import SluiceError
from sluice.gateway.admin import AdminApi
from sluice.gateway.auth import Auth
from sluice.gateway.compat import CompatAPI
from sluice.gateway.cors import CorsMiddleware, CorsPolicy
from sluice.gateway.durable_streams import DurableStreamsApi
from sluice.gateway.errors import error_response, response_for
from sluice.gateway.hosts import HostPolicy
from sluice.gateway.limits import check_head
from sluice.gateway.longpoll import LongPolls
from sluice.gateway.openapi import openapi_endpoint
from sluice.gateway.protocol import GatewayOpener
from sluice.gateway.responses_socket import RESPONSES_WS_PATH, ResponsesSockets
from sluice.gateway.routes import NativeApi
from sluice.gateway.settings import Settings
from sluice.gateway.streaming import EventStreams
from sluice.gateway.websocket import WebSockets
from sluice.runtime import Resource, Runtime
from sluice.streams.durable import DurableStreams
from sluice.transports.asgi import Receive, Scope, Send
from sluice.transports.http2 import serving_http2

if TYPE_CHECKING:  # loaded only with --models-config (it imports scipy)
    from sluice.rollout.controller import Rollouts

__all__ = ["SluiceApp", "create_app"]

logger = logging.getLogger(__name__)


class SluiceApp:
    """The ASGI callable; ``hub`` is exposed for operations and tests, ``opener`` for the
    native HTTP/1.1 path of ``sluice serve`` (:mod:`sluice.transports.http1`)."""

    def __init__(
        self,
        settings: Settings,
        runtime: Runtime,
        auth: Auth | None = None,
        rollouts: Rollouts | None = None,
    ) -> None:
        self.settings = settings
        self.runtime = runtime
        self.rollouts = rollouts
        self.auth = auth or Auth.anonymous()
        self.grpc_port: int | None = None  # the gRPC front's port while it runs
        self.frames = runtime.frames
        self.metrics = runtime.metrics
        self.hub = runtime.hub
        keyless = self.auth.allow_anonymous
        self.cors = CorsPolicy.by_mode(settings.cors_allow_origins, keyless_callers=keyless)
        self.hosts = HostPolicy.by_mode(settings.allowed_hosts, keyless_callers=keyless)
        self.streams = EventStreams(
            self.hub,
            settings,
            self.metrics,
            self.auth,
            cors=self.cors,
            hosts=self.hosts,
            frames=self.frames,
        )
        # GET /v1/ws: the native API over WebSockets (sluice.gateway.websocket).
        self.websockets = WebSockets(
            self.hub, settings, self.metrics, self.auth, cors=self.cors, hosts=self.hosts
        )
        page = package_data.files("sluice.web").joinpath("index.html").read_text("utf-8")
        api = NativeApi(self.hub, settings, page, self.metrics, self.auth)
        compat = CompatAPI(
            self.hub, settings, self.streams.options, self.metrics, self.auth, self.frames
        )
        # GET /v1/responses as a WebSocket: the Responses API's WebSocket mode, with the
        # same checks and limits as /v1/ws (sluice.gateway.responses_socket).
        self.responses_sockets = ResponsesSockets(
            self.hub,
            compat,
            settings,
            self.auth,
            cors=self.cors,
            hosts=self.hosts,
            limits=self.websockets.limits,
        )
        # What `sluice serve`'s native HTTP/1.1 path asks of the app (sluice.transports.http1).
        self.opener = GatewayOpener(
            settings, self.streams, compat, self.metrics, cors=self.cors, hosts=self.hosts
        )
        dashboard = package_data.files("sluice.web").joinpath("dashboard.html").read_text("utf-8")
        admin = AdminApi(rollouts, self.auth, dashboard, self.metrics)
        polls = LongPolls(self.hub, self.metrics, self.auth)
        # /v1/ds/: the Durable Streams protocol, on the hub's logs (sluice.gateway.durable_streams).
        self.durable = DurableStreams(self.hub)
        self._durable_api = DurableStreamsApi(
            self.hub,
            self.durable,
            self.auth,
            self.cors,
            settings.durable,
            settings.http.max_body_bytes,
        )
        self._framework = Starlette(
            routes=[
                Route("/", api.page, methods=["GET"]),
                Route("/healthz", api.healthz, methods=["GET"]),
                Route("/readyz", api.readyz, methods=["GET"]),
                Route("/metrics", api.metrics, methods=["GET"]),
                Route("/openapi.json", openapi_endpoint(settings), methods=["GET"]),
                Route("/v1/models", api.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
                Route("/v1/streams", api.create_stream, methods=["POST"]),
                Route("/v1/streams/{stream_id}", api.get_stream, methods=["GET"]),
                Route("/v1/streams/{stream_id}/cancel", api.cancel_stream, methods=["POST"]),
                Route("/v1/streams/{stream_id}/drop", api.drop_connections, methods=["POST"]),
                Route("/v1/streams/{stream_id}/poll", polls.poll, methods=["GET"]),
                *compat.routes(),
                Route("/dashboard", admin.dashboard, methods=["GET"]),
                Route("/v1/admin/rollouts", admin.rollouts, methods=["GET"]),
                Route("/v1/admin/rollouts/{alias:path}", admin.act, methods=["POST"]),
            ],
            middleware=[Middleware(CorsMiddleware, policy=self.cors)],
            exception_handlers={HTTPException: _http_error},
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with self.runtime.running(), contextlib.AsyncExitStack() as fronts:
            settings = self.settings
            if settings.grpc_port is not None:
                # Imported on demand: grpcio and the generated messages load only for gRPC.
                from sluice.grpc_api.server import serving

                front = serving(
                    self.runtime, settings, self.auth, settings.grpc_host, settings.grpc_port
                )
                self.grpc_port = await fronts.enter_async_context(front)
                logger.info("gRPC on %s:%d", settings.grpc_host, self.grpc_port)
            if settings.http2 is not None:
                port = await fronts.enter_async_context(
                    serving_http2(self, self.opener, settings.http2)
                )
                scheme = "https" if settings.http2.tls else "http (h2c)"
                logger.info("HTTP/2 on %s://%s:%d", scheme, settings.http2.host, port)
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                check_head(scope, self.settings)
                self.hosts.check(scope)
            except SluiceError as exc:
                await response_for(exc)(scope, receive, send)
                return
            if self.cors.is_preflight(scope):
                await self.cors.preflight(scope, receive, send)
                return
            if DurableStreamsApi.serves_path(scope["path"]):
                await self._durable_api(scope, receive, send)
                return
            if EventStreams.serves_path(scope["path"]):
                if scope["method"] == "GET":
                    await self.streams(scope, receive, send)
                else:
                    allow = {"Allow": "GET"}
                    response = error_response(405, "method_not_allowed", "use GET", headers=allow)
                    await CorsMiddleware(response, self.cors)(scope, receive, send)
                return
        elif scope["type"] == "websocket":
            if scope["path"] == RESPONSES_WS_PATH:
                await self.responses_sockets(scope, receive, send)
            else:
                await self.websockets(scope, receive, send)
            return
        await self._framework(scope, receive, send)


# The API whose error shape unknown paths under it get (the others: the native shape).
_ANTHROPIC_PREFIX = "/v1/messages"


async def _http_error(request: Request, exc: Exception) -> Response:
    """A routing error (404, 405 with ``Allow``) in the shape of the API the path is under."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal server error"
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    if "Allow" in headers:  # Starlette lists a set: one order, whatever the hash seed
        headers["Allow"] = ", ".join(sorted(headers["Allow"].split(", ")))
    path: str = request.scope["path"]
    if path == _ANTHROPIC_PREFIX or path.startswith(_ANTHROPIC_PREFIX + "/"):
        body = api_dialect("anthropic").error_body(status, str(detail))
        return JSONResponse(body, status_code=status, headers=headers or None)
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
    return error_response(status, code, str(detail), headers=headers or None)


def create_app(
    settings: Settings | None = None,
    backends: Mapping[str, Backend] | None = None,
    resources: Sequence[Resource] = (),
    auth: Auth | None = None,
    rollouts: Rollouts | None = None,
) -> SluiceApp:
    """Build the app; ``backends`` come first in ``/v1/models``, then ``words``, always served.

    The :class:`~sluice.runtime.Runtime` it builds runs for the app's lifespan.
    ``resources`` are entered for the app's lifetime, before the hub starts (for example
    the driver thread of an embedded engine). ``auth`` holds the API keys and the resume
    token secret; without it every caller is tenant ``"anonymous"``. ``rollouts`` are the
    model aliases' rollouts (their backends are among ``backends``), for the admin API.
    """
    settings = settings or Settings()
    auth = auth or Auth.anonymous()
    served: dict[str, Backend] = {**(backends or {})}
    served.setdefault("words", WordsBackend())
    runtime = Runtime(
        served,
        log_limits=settings.log_limits,
        # Per-tenant limits default to the server's when there is one tenant (no keys).
        hub_settings=settings.hub_settings(multi_tenant=auth.num_keys > 0),
        resources=resources,
        shared=settings.shared,
    )
    return SluiceApp(settings, runtime, auth, rollouts)
