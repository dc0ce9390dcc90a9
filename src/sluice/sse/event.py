"""The value the SSE decoder produces: one dispatched server-sent event.

It mirrors the three attributes a browser's ``MessageEvent`` carries for an event
stream (WHATWG HTML §9.2.6 "Interpreting an event stream", dispatch steps 4-6):
``type``, ``data`` and ``lastEventId``. Events are frozen and compare by value, so
tests can say ``assert events == [Event("hi")]``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Event"]


@dataclass(frozen=True, slots=True)
class Event:
    """One dispatched server-sent event.

    ``data``
        The event's data: its ``data`` field values joined with LF (§9.2.6: each value is
        appended with an LF and the final LF is removed at dispatch).
    ``event``
        The event type; ``"message"`` when the event had no ``event`` field or an empty
        one (§9.2.6, dispatch step 6).
    ``id``
        The last event ID in force when the event was dispatched (the browser's
        ``lastEventId``). It persists across events until an ``id`` field changes it, so
        an event without its own ``id`` field carries the previous one (§9.2.6, dispatch
        step 1).
    """

    data: str
    event: str = "message"
    id: str = ""
