"""Server-sent events (WHATWG HTML §9.2) as a sans-IO wire format.

Bytes in, events out (:class:`Decoder`); values in, bytes out (:func:`encode_event`,
:func:`encode_comment`, :func:`encode_retry`). Nothing here does I/O or needs an event
loop, in the manner of h11.
"""

from __future__ import annotations

from sluice.sse.decoder import (
    DEFAULT_MAX_EVENT_CHARS,
    DEFAULT_MAX_LINE_BYTES,
    MAX_RETRY_MS,
    Decoder,
)
from sluice.sse.encoder import EventEncoder, encode_comment, encode_event, encode_retry
from sluice.sse.event import Event

__all__ = [
    "DEFAULT_MAX_EVENT_CHARS",
    "DEFAULT_MAX_LINE_BYTES",
    "MAX_RETRY_MS",
    "Decoder",
    "Event",
    "EventEncoder",
    "encode_comment",
    "encode_event",
    "encode_retry",
]
