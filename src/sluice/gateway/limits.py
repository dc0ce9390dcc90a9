"""Bounds on request heads: the request target and the header lines.

uvicorn's httptools protocol bounds neither, so they are enforced twice: while parsing, by
:class:`~sluice.gateway.protocol.SluiceHttpProtocol` (``sluice serve``), and on every
request that reaches the ASGI app (:func:`check_head`), for any other server.
"""

from __future__ import annotations

from collections.abc import Iterable

from sluice.gateway.errors import HeadersTooLargeError, UrlTooLongError
from sluice.gateway.settings import Settings
from sluice.transports.asgi import Scope

__all__ = ["HEADER_LINE_OVERHEAD", "check_head", "header_bytes_error", "url_bytes_error"]

# ": " between name and value and the CRLF after it: a header line as it came on the wire.
HEADER_LINE_OVERHEAD = 4


def url_bytes_error(num_url_bytes: int, settings: Settings) -> UrlTooLongError | None:
    if num_url_bytes <= settings.http.max_url_bytes:
        return None
    return UrlTooLongError(f"request target over {settings.http.max_url_bytes} bytes")


def header_bytes_error(num_header_bytes: int, settings: Settings) -> HeadersTooLargeError | None:
    if num_header_bytes <= settings.http.max_header_bytes:
        return None
    return HeadersTooLargeError(f"request header lines over {settings.http.max_header_bytes} bytes")


def _num_header_bytes(headers: Iterable[tuple[bytes, bytes]]) -> int:
    return sum(len(name) + len(value) + HEADER_LINE_OVERHEAD for name, value in headers)


def check_head(scope: Scope, settings: Settings) -> None:
    """Raise if a request's target or header lines are over the bounds."""
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    query: bytes = scope["query_string"]
    url_error = url_bytes_error(len(raw_path) + (len(query) + 1 if query else 0), settings)
    if url_error is not None:
        raise url_error
    header_error = header_bytes_error(_num_header_bytes(scope["headers"]), settings)
    if header_error is not None:
        raise header_error
