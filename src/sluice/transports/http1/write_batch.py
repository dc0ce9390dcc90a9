"""The stream writes of one event-loop pass, made back to back at its end.

An engine step hands a token to every stream at once, and the producers append them in one
loop pass: N appends, each waking its connection's writer. Written at once, the N sends
are spread over the pass, a producer's work apart (tens of microseconds), and the reader
on the other end of each (a client process, often idle between tokens) is woken by each;
on a VM a send that wakes an idle peer costs several times one that finds it running
(``bench/fanout_floor.py`` prints a send's cost; the sends of ``sluice serve`` were 40% of
its CPU at 300 engine-shaped streams). So an exchange's writes go to a
:class:`WriteBatch`, which writes every pending exchange's bytes in one callback at the
start of the next pass (``call_soon``: before the loop polls for I/O again, so no token
waits for another step or for the network): the sends come back to back, and several
frames for one connection in one pass are one send.

What is pending belongs to its exchange (:class:`Pending`): it is written before anything
the exchange writes directly (the end of its body, a whole response) and dropped when the
connection is lost. Backpressure is unchanged: the transport reports a full buffer during
the batch's write, and the writer stops reading the log then; one pass's frames are what
can be pending, and they were already in the log.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["Pending", "WriteBatch"]


class Pending(Protocol):
    """An exchange with bytes waiting for the batch."""

    def flush(self) -> None:
        """Write what is pending now (nothing if the connection is gone)."""
        ...


class WriteBatch:
    """The exchanges with pending writes, flushed together once per loop pass."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[Pending] = []

    def add(self, exchange: Pending) -> None:
        """``exchange`` has bytes to write (call once per pass: when its first arrive)."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(exchange)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for exchange in pending:
            exchange.flush()
