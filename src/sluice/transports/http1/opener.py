"""The seam between the native HTTP/1.1 path and the application that answers on it.

The transport parses, bounds and times requests; the application (the gateway) decides
what they get. It hands the protocol an :class:`Opener`: at the end of a request's head
the protocol asks :meth:`Opener.route` whether the native path answers it (the SSE reads,
the compatible APIs' ``POST``) and, if so, runs the :class:`Route`'s
:meth:`~Route.answer` with the request's body as it arrives, then writes the
:data:`~sluice.transports.answer.Answer` it gets: a whole response, or a reader to stream
through the delivery core. Everything else goes to the ASGI app. What the transport itself
refuses (a head over its bounds or too slow, a connection over the limit) is worded by the
opener too (:meth:`Opener.refusal`), so every error has the application's shape.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from sluice.transports.answer import Answer, Whole
from sluice.transports.asgi import Scope
from sluice.transports.delivery import DeliveryOptions
from sluice.transports.http1.write_batch import WriteBatch

__all__ = ["BodySource", "Http1Limits", "Opener", "Refusal", "Route"]

BodySource = Callable[[int], Awaitable[bytes]]
"""The request's body, awaited whole: at most ``max_bytes`` of it, or, when more came,
``max_bytes + 1`` bytes (the rest was dropped). A client that leaves before sending it all
cancels the route."""


@dataclass(frozen=True, slots=True)
class Http1Limits:
    """The bounds the protocol enforces on every request, while it parses it."""

    max_url_bytes: int = 8 * 1024
    max_header_bytes: int = 16 * 1024
    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # What the native path buffers of a body (the ASGI app bounds its own bodies).
    max_body_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        if min(self.max_url_bytes, self.max_header_bytes, self.max_body_bytes) < 1:
            raise ValueError("HTTP/1.1 limits must be positive")
        if not (self.head_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("HTTP/1.1 deadlines must be positive")


class Refusal(enum.Enum):
    """Why the protocol refuses a request itself."""

    URL_TOO_LONG = "url_too_long"  # 414
    HEADERS_TOO_LARGE = "headers_too_large"  # 431
    HEAD_TIMEOUT = "head_timeout"  # 408
    BODY_TIMEOUT = "body_timeout"  # 408
    TOO_MANY_CONNECTIONS = "too_many_connections"  # 503 (an SSE read: a retry: hint)


class Route(Protocol):
    """One kind of request the native path answers."""

    @property
    def takes_body(self) -> bool:
        """Whether :meth:`answer` reads the body (else the protocol drops it)."""
        ...

    async def answer(self, scope: Scope, body: BodySource) -> Answer:
        """What the request gets; never raises for a request it refuses (that is an
        answer too). Cancelled when the client leaves before the answer is written."""
        ...


class Opener(Protocol):
    """What the native HTTP/1.1 path needs of the application."""

    @property
    def limits(self) -> Http1Limits: ...

    @property
    def delivery(self) -> DeliveryOptions:
        """How streamed answers are delivered (heartbeats, send timeout, ...)."""
        ...

    @property
    def writes(self) -> WriteBatch:
        """The server's batch of stream writes (one per server: its loop pass)."""
        ...

    def began(self, scope: Scope) -> None:
        """A request's first bytes arrived now (``scope`` holds only what is known yet)."""
        ...

    def route(self, method: str, path: str) -> Route | None:
        """The route that answers ``method path`` on the native path, or ``None`` for the
        ASGI app."""
        ...

    def refusal(self, reason: Refusal, method: str | None, path: str | None) -> Whole:
        """The answer to a request the protocol refuses (``method``/``path``: what is known
        of it, to pick the answer's shape)."""
        ...
