"""The JSON endpoints of the native API, the page, and the health checks."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from sluice.dialects.registry import api_dialect
from sluice.errors import BadEventIdError, SluiceError
from sluice.gateway.auth import TOKEN_PARAM, Auth, Caller, presented_token
from sluice.gateway.creation import create_native_stream
from sluice.gateway.errors import refusal_response, response_for
from sluice.gateway.requests import (
    read_json_body,
)
from sluice.gateway.settings import Settings
from sluice.observability.metrics import Metrics
from sluice.streams.hub import Stream, StreamHub
from sluice.streams.ids import is_stream_id

__all__ = ["NativeApi"]


class NativeApi:
    """Request handlers bound to one hub."""

    def __init__(
        self, hub: StreamHub, settings: Settings, page_html: str, metrics: Metrics, auth: Auth
    ) -> None:
        self._hub = hub
        self._settings = settings
        self._page_html = page_html
        self._metrics = metrics
        self._auth = auth
        # ``created`` of every model in /v1/models: when this server began to serve them.
        self._models_created = int(time.time())

    def _caller(self, request: Request) -> Caller:
        headers = request.scope["headers"]
        token = presented_token(headers, request.query_params.get(TOKEN_PARAM))
        return self._auth.caller(headers, token)

    def _stream(self, request: Request) -> Stream:
        """The stream a request names, if its caller may touch it (401 first, then 404)."""
        caller = self._caller(request)
        stream_id = request.path_params["stream_id"]
        if not is_stream_id(stream_id):
            raise BadEventIdError(f"malformed stream id {stream_id[:80]!r}")
        return self._auth.find(self._hub.get, stream_id, caller)

    async def create_stream(self, request: Request) -> Response:
        scope = request.scope
        try:
            tenant = self._auth.creator(scope["headers"])  # 401 before the body is read
            payload = await read_json_body(
                scope, request.receive, self._settings.http.max_body_bytes
            )
        except SluiceError as exc:
            self._metrics.refused_before_start(exc)
            return response_for(exc)
        try:
            created = await create_native_stream(
                self._hub, self._settings, self._metrics, payload, scope, tenant
            )
        except SluiceError as exc:  # counted where it was raised
            return response_for(exc)
        stream, versioned = created.stream, created.versioned
        if created.refused is not None:  # the backend refused it: a status, not 201
            return refusal_response(created.refused, stream.refusal)
        base = f"/v1/streams/{stream.id}"
        token = self._auth.tokens.mint(stream.id)
        payload = {
            **stream.describe(),
            # EventSource cannot send a key: the events URL carries the stream's capability.
            "events_url": f"{base}/events?{TOKEN_PARAM}={token}",
            "cancel_url": f"{base}/cancel",
            "resume_token": token,
        }
        headers = {"Location": base, **versioned}
        return JSONResponse(payload, status_code=201, headers=headers)

    async def _attach(self, request: Request) -> None:
        """Make the stream the request names known here, if another replica runs it."""
        stream_id = request.path_params["stream_id"]
        if is_stream_id(stream_id):
            await self._hub.attach(stream_id)

    async def get_stream(self, request: Request) -> Response:
        try:
            await self._attach(request)
            return JSONResponse(self._stream(request).describe())
        except SluiceError as exc:
            return response_for(exc)

    async def cancel_stream(self, request: Request) -> Response:
        try:
            await self._attach(request)
            stream = self._hub.cancel(self._stream(request).id)
        except SluiceError as exc:
            return response_for(exc)
        return JSONResponse(stream.describe(), status_code=202)

    async def drop_connections(self, request: Request) -> Response:
        try:
            await self._attach(request)
            stream = self._stream(request)
            dropped = self._hub.drop_connections(stream.id)
        except SluiceError as exc:
            return response_for(exc)
        return JSONResponse({"id": stream.id, "dropped": dropped})

    async def models(self, request: Request) -> Response:
        try:
            self._auth.caller(request.scope["headers"])
        except SluiceError as exc:
            return response_for(exc)
        data = [self._model(model) for model in self._hub.models]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}`` (OpenAI's retrieve); an unknown id is OpenAI's 404."""
        try:
            self._auth.caller(request.scope["headers"])
        except SluiceError as exc:
            return response_for(exc)
        model_id: str = request.path_params["model_id"]
        if model_id not in self._hub.backends:
            message = f"The model {model_id[:200]!r} does not exist"
            body = api_dialect("openai_chat").error_body(
                404, message, code="model_not_found", param="model"
            )
            return JSONResponse(body, status_code=404)
        return JSONResponse(self._model(model_id))

    def _model(self, model_id: str) -> dict[str, object]:
        """One model as OpenAI lists it."""
        created = self._models_created
        return {"id": model_id, "object": "model", "created": created, "owned_by": "sluice"}

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self._page_html, headers={"Cache-Control": "no-cache"})

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        """Ready, with the streams held and each embedded engine's queues and KV cache."""
        if self._hub.draining:  # load balancers: send new work elsewhere
            return JSONResponse({"status": "draining", "streams": len(self._hub)}, 503)
        engines = {name: await stats() for name, stats in engine_stats(self._hub).items()}
        payload = {"status": "ready", "streams": len(self._hub), "engines": engines}
        return JSONResponse(payload)

    async def metrics(self, request: Request) -> Response:
        live = self._hub.live_streams()
        accept = request.headers.get("accept", "")  # OpenMetrics when asked for
        body, content_type = await self._metrics.render(engine_stats(self._hub), live, accept)
        return Response(body, media_type=content_type)


def engine_stats(hub: StreamHub) -> dict[str, Callable[[], Awaitable[dict[str, int]]]]:
    """The ``stats()`` of every backend that has one (the embedded engines)."""
    found = {}
    for name, backend in hub.backends.items():
        stats = getattr(backend, "stats", None)
        if stats is not None:
            found[name] = stats
    return found
