"""Creating a native stream: ``POST /v1/streams``'s work, shared by every front that
creates one (the HTTP route, a WebSocket ``create``, gRPC's ``Generate``).

The body is validated against the model and the server's bounds, the stream is created
for the caller's tenant and admitted by its backend before anything is answered, and the
refusals are counted once: an error raised before the stream exists (bad body, auth,
limits) in ``refused_before_start``, a backend that refused the work (its first event is
an ``Error``) by its type.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.errors import SluiceError
from sluice.events import Error
from sluice.gateway.requests import (
    generation_request,
    parse_create_stream,
    received,
    version_headers,
)
from sluice.gateway.settings import Settings
from sluice.observability.metrics import Metrics
from sluice.streams.hub import Stream, StreamHub
from sluice.transports.asgi import Scope

__all__ = ["Created", "create_native_stream"]


@dataclass(frozen=True, slots=True)
class Created:
    """A created stream; ``refused`` is its backend's refusal (its first event), if any."""

    stream: Stream
    refused: Error | None
    # X-Sluice-Model-Version for a stream of a model alias (read before it may end).
    versioned: dict[str, str]


async def create_native_stream(
    hub: StreamHub,
    settings: Settings,
    metrics: Metrics,
    payload: object,
    scope: Scope,
    tenant: str,
) -> Created:
    """Create the stream a ``POST /v1/streams`` body asks for, for ``tenant`` (the front
    authenticated the caller: :meth:`~sluice.gateway.auth.Auth.creator`); raises
    :class:`~sluice.errors.SluiceError` for a refusal before it exists (counted here: the
    front counts its own, e.g. an unreadable body)."""
    try:
        body = parse_create_stream(payload, settings)
        stream = await hub.create(
            body.model or settings.requests.default_model,
            received(generation_request(body), scope, tenant),
            resumable=body.resumable,
            grace_s=body.grace_s,
            tenant=tenant,
        )
        versioned = version_headers(stream.generation)
        first = await hub.first_event(stream.id)
    except SluiceError as exc:
        metrics.refused_before_start(exc)
        raise
    if isinstance(first, Error):
        metrics.refusals.labels(first.type).inc()
        return Created(stream, first, versioned)
    return Created(stream, None, versioned)
