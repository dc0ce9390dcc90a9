"""HTTP/1.1 response bytes: a status line, validated header fields, chunks. Sans-IO.

Every function is pure and returns bytes to write as they are (RFC 9112 for the message
syntax, RFC 9110 for the fields):

- :func:`response_head`: ``HTTP/1.1 <status> <reason>`` (RFC 9112 section 4), the header
  fields (section 5), then an empty line. Names must be tokens (RFC 9110 section 5.1)
  and values field-values (section 5.5: visible ASCII, obs-text, SP and HTAB inside, none
  at either end); anything else raises :class:`InvalidHeaderError` instead of being
  written, so a value that carried CR or LF can never split the response.
- :func:`chunk` and :data:`LAST_CHUNK`: chunked transfer coding (RFC 9112 section 7.1),
  without extensions or trailers.

Decisions:

1. Names are written as given; callers pass them in lower case, as ASGI does.
2. ``connection: close`` is added when ``keep_alive`` is false (RFC 9112 section 9.6) and
   ``transfer-encoding: chunked`` when ``chunked``; a caller does not list either itself.
3. A reason phrase is the one :class:`http.HTTPStatus` names, or empty (RFC 9112 section
   4 allows an empty one) for a status it does not know (``499``).
4. An empty chunk is never written: it would end the body (:func:`chunk` refuses it).
"""

from __future__ import annotations

import http
import re
from collections.abc import Iterable

__all__ = ["LAST_CHUNK", "InvalidHeaderError", "chunk", "response_head", "status_line"]

LAST_CHUNK = b"0\r\n\r\n"
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# RFC 9110 section 5.5: field-value = *field-content; VCHAR / obs-text, with SP and HTAB
# only between them.
_FIELD_VALUE = re.compile(
    rb"(?:[\x21-\x7e\x80-\xff](?:[\x20\x09\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?"
)
_MIN_STATUS, _MAX_STATUS = 100, 599


class InvalidHeaderError(ValueError):
    """A header name or value that HTTP/1.1 cannot carry as given."""


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("ascii")


_STATUS_LINES = {status: _status_line(status) for status in range(_MIN_STATUS, _MAX_STATUS + 1)}


def status_line(status: int) -> bytes:
    """The status line of ``status`` (a three-digit code), CRLF included."""
    line = _STATUS_LINES.get(status)
    if line is None:
        raise ValueError(f"not an HTTP status code: {status!r}")
    return line


def response_head(
    status: int,
    headers: Iterable[tuple[bytes, bytes]],
    *,
    chunked: bool = False,
    keep_alive: bool = True,
) -> bytes:
    """A response's status line and header section, up to and with its empty line."""
    parts = [status_line(status)]
    for name, value in headers:
        if not _TOKEN.fullmatch(name):
            raise InvalidHeaderError(f"invalid header name {name[:40]!r}")
        if not _FIELD_VALUE.fullmatch(value):
            raise InvalidHeaderError(f"invalid value of header {name.decode('ascii')!r}")
        parts += [name, b": ", value, b"\r\n"]
    if chunked:
        parts.append(b"transfer-encoding: chunked\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (it must not be empty)."""
    if not data:
        raise ValueError("an empty chunk would end the body; write LAST_CHUNK for that")
    return b"%x\r\n%b\r\n" % (len(data), data)
