"""Read deadlines of one HTTP/1.1 connection: a request's head, then its body, in bounded time.

uvicorn bounds only the silence between two requests (``timeout_keep_alive``, armed after a
response). Without more, a client that connects and says nothing, sends its head a byte
at a time (slowloris) or its body a byte at a time holds the connection, and a file
descriptor, for ever. :class:`ReadDeadline` is the one timer that bounds what a
connection is reading now:

========  ===========================================  ==================================
phase     from                                         until
========  ===========================================  ==================================
``HEAD``  the connection is made, or (kept alive) the   the end of the head (``head_s``)
          first byte of a request arrives
``BODY``  the end of the head                           the end of the body (``body_s``)
``NONE``  the request was read whole; between two      (uvicorn's keep-alive timeout)
          requests on a kept-alive connection
========  ===========================================  ==================================

The head's deadline runs from the connection's start for its first request, so a silent
connection is closed within ``head_s`` of connecting. Time during which the *server* had
stopped reading (a pipelined request waiting its turn, a body the app has not taken yet)
is not the client's: a deadline that expires then starts again instead of firing.

Sans-IO apart from the event loop's clock: the protocol reports what it parsed, and is
called back with the phase whose deadline passed; what to answer is its business.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

__all__ = ["ReadDeadline", "ReadPhase"]


class ReadPhase(enum.Enum):
    """What a connection is reading under a deadline now."""

    NONE = "none"
    HEAD = "head"
    BODY = "body"


class ReadDeadline:
    """The deadline of one connection's current read: one timer at most."""

    __slots__ = ("_body_s", "_head_s", "_loop", "_on_expired", "_reading_paused", "_timer", "phase")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        head_s: float,
        body_s: float,
        on_expired: Callable[[ReadPhase], None],
        reading_paused: Callable[[], bool],
    ) -> None:
        self._loop = loop
        self._head_s = head_s
        self._body_s = body_s
        self._on_expired = on_expired
        self._reading_paused = reading_paused
        self._timer: asyncio.TimerHandle | None = None
        self.phase = ReadPhase.NONE

    def head_begins(self) -> None:
        """The connection was made, or a request's first byte arrived: its head is due
        within ``head_s``. A head deadline already running (from the connection's start)
        keeps running."""
        if self.phase is not ReadPhase.HEAD:
            self._arm(ReadPhase.HEAD)

    def head_complete(self) -> None:
        """The head is in: the body (if any) is due within ``body_s``."""
        self._arm(ReadPhase.BODY)

    def body_complete(self) -> None:
        """The request was read whole: nothing is due."""
        self.cancel()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.phase = ReadPhase.NONE

    def _arm(self, phase: ReadPhase) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.phase = phase
        timeout_s = self._head_s if phase is ReadPhase.HEAD else self._body_s
        self._timer = self._loop.call_later(timeout_s, self._expire)

    def _expire(self) -> None:
        self._timer = None
        phase = self.phase
        if self._reading_paused():
            self._arm(phase)  # the server was not reading: the time was not the client's
            return
        self.phase = ReadPhase.NONE
        self._on_expired(phase)
