"""CORS: which web origins may call the API, and the headers that tell browsers so.

One :class:`CorsPolicy` answers every path: preflights (:meth:`CorsPolicy.preflight`,
answered before routing), the framework's responses (:class:`CorsMiddleware`) and the SSE
reads, which the native fast path writes without any middleware
(:meth:`CorsPolicy.response_headers`). Fetch standard, section 3.2 (the CORS protocol).

Decisions:

1. Default origins: none but the server's own (no CORS headers at all) while callers
   without a key are served, since any page its operator opens could otherwise drive the
   model and read the answers; any origin (``*``) when every caller needs a key, which a
   page on another origin does not hold. ``--cors-origin`` overrides either.
2. A preflight from an allowed origin allows every request header it asks for (the list is
   echoed back, as Starlette's ``allow_headers=["*"]`` does). The official SDKs send their
   own headers (``x-stainless-*``, ``anthropic-*``, ``openai-*``), which change with their
   releases; an origin the operator trusts gains nothing from being refused a header the
   server ignores. The literal ``*`` is not sent: Fetch leaves ``Authorization`` out of it.
3. No credentials (cookies): the API authenticates with headers, never cookies.
4. A preflight from an origin that is not allowed, or for another method than GET and
   POST, is answered ``403`` with a JSON error and no CORS headers: the browser does not
   send the request.
5. ``Vary: Origin`` goes with every answer that depends on the origin (a list of them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sluice.errors import ConfigError
from sluice.gateway.errors import error_response
from sluice.transports.asgi import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ANY_ORIGIN", "CorsMiddleware", "CorsPolicy", "parse_origin"]

ANY_ORIGIN = "*"
# How long a browser may cache a preflight's answer.
PREFLIGHT_MAX_AGE_S = 600
_METHODS = ("GET", "POST")
# Response headers that scripts on an allowed origin may read (beyond the safelisted ones).
_EXPOSED = ("X-Sluice-Stream-Id", "X-Sluice-Resume-Token", "Retry-After", "Location")
# RFC 9110 section 5.6.2: a header name is a token.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# scheme "://" host [":" port], nothing after: what browsers send in Origin.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9._~%!$&'()*+,;=-]+)(:[0-9]+)?")


def parse_origin(text: str) -> str:
    """A ``--cors-origin`` value, normalised; raises :class:`ConfigError` for anything a
    browser never sends as ``Origin`` (a path, a trailing slash, no scheme)."""
    if text == ANY_ORIGIN:
        return text
    lowered = text.strip().lower()
    if not _ORIGIN.fullmatch(lowered):
        raise ConfigError(
            f"CORS origin {text[:80]!r}: give scheme://host[:port] (no path, no trailing "
            "slash), as browsers send it in Origin, or '*'"
        )
    return lowered


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """The origins other than the server's own that may call it; ``any_origin``: all."""

    origins: frozenset[str] = frozenset()
    any_origin: bool = False

    @classmethod
    def of(cls, origins: Iterable[str]) -> CorsPolicy:
        normalised = [parse_origin(text) for text in origins]
        if ANY_ORIGIN in normalised:
            return cls(any_origin=True)
        return cls(frozenset(normalised))

    @classmethod
    def by_mode(cls, origins: Sequence[str] | None, *, keyless_callers: bool) -> CorsPolicy:
        """``origins`` if given (``Settings.cors_allow_origins``); else same-origin only
        while callers without a key are served, and any origin when every caller needs one."""
        if origins is not None:
            return cls.of(origins)
        return cls() if keyless_callers else cls(any_origin=True)

    def _allowed(self, origin: bytes) -> bool:
        return self.any_origin or origin.decode("latin-1").lower() in self.origins

    def allows(self, origin: bytes) -> bool:
        """Whether pages of ``origin`` (an ``Origin`` value) may call the server, beside
        its own origin (a WebSocket handshake checks it: browsers send no preflight)."""
        return self._allowed(origin)

    def response_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The CORS headers of an answer to a request with these (ASGI) headers."""
        if self.any_origin:
            return [(b"access-control-allow-origin", b"*"), _EXPOSE_HEADER]
        if not self.origins:
            return []
        origin = _header(headers, b"origin")
        if origin is None or not self._allowed(origin):
            return [_VARY]
        return [(b"access-control-allow-origin", origin), _EXPOSE_HEADER, _VARY]

    @staticmethod
    def is_preflight(scope: Scope) -> bool:
        if scope["method"] != "OPTIONS":
            return False
        headers = scope["headers"]
        return (
            _header(headers, b"origin") is not None
            and _header(headers, b"access-control-request-method") is not None
        )

    async def preflight(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a preflight (:meth:`is_preflight`)."""
        headers = scope["headers"]
        origin = _header(headers, b"origin") or b""
        method = (_header(headers, b"access-control-request-method") or b"").decode("latin-1")
        requested = (_header(headers, b"access-control-request-headers") or b"").decode("latin-1")
        names = [name.strip() for name in requested.split(",") if name.strip()]
        refusal = None
        if not self._allowed(origin):
            refusal = f"origin {origin.decode('latin-1')[:80]!r} may not call this server"
        elif method not in _METHODS:
            refusal = f"method {method[:20]!r} is not served to other origins"
        elif not all(_TOKEN.fullmatch(name) for name in names):
            refusal = "malformed Access-Control-Request-Headers"
        if refusal is not None:
            response = error_response(403, "cors_refused", f"CORS preflight refused: {refusal}")
            await response(scope, receive, send)
            return
        answer = [
            (b"access-control-allow-origin", b"*" if self.any_origin else origin),
            (b"access-control-allow-methods", ", ".join(_METHODS).encode()),
            (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode()),
            (b"vary", b"Origin, Access-Control-Request-Headers"),
        ]
        if names:
            answer.append((b"access-control-allow-headers", ", ".join(names).encode("latin-1")))
        await send({"type": "http.response.start", "status": 204, "headers": answer})
        await send({"type": "http.response.body", "body": b""})


class CorsMiddleware:
    """Adds a policy's CORS headers to every response of ``app`` (preflights are answered
    before it, by :meth:`CorsPolicy.preflight`)."""

    def __init__(self, app: ASGIApp, policy: CorsPolicy) -> None:
        self._app = app
        self._policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        extra = self._policy.response_headers(scope["headers"])
        if not extra:
            await self._app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self._app(scope, receive, send_with_cors)


_EXPOSE_HEADER = (b"access-control-expose-headers", ", ".join(_EXPOSED).encode())
_VARY = (b"vary", b"Origin")


def _header(headers: Iterable[tuple[bytes, bytes]], wanted: bytes) -> bytes | None:
    for name, value in headers:
        if name == wanted:
            return value
    return None
