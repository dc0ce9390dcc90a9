"""Neutral events as the native dialect's JSON: what the JSON transports carry.

WebSocket frames (:mod:`sluice.transports.websocket_protocol`) and long-poll batches
(:mod:`sluice.transports.longpoll`) carry each event as its native name and data (the
``event:`` and ``data:`` of the native SSE frame, :mod:`sluice.dialects.native`) with its
id ``<stream_id>:<n>``. The log holds neutral events, so any stream reads natively on
these transports, whichever dialect created it; a cursor from any transport's native
read resumes on any other.

Sans-IO: values in, bytes out. The data is the native renderer's JSON text, embedded as
it is (never parsed and dumped again).
"""

from __future__ import annotations

from sluice.dialects.registry import NATIVE
from sluice.events import NeutralEvent, RenderMeta

__all__ = ["native_message"]

# Stateless (its meta is not read), as in sluice.transports.frames.
_RENDERER = NATIVE.renderer(RenderMeta(NATIVE.name, "", "", 0, resumable=True))


def native_message(event: NeutralEvent) -> tuple[str, str]:
    """The native event name and JSON data text of ``event``."""
    ((name, data),) = _RENDERER.render(event)
    return name or "message", data
