"""Running a send eagerly: in the caller's own call, until it first has to wait.

A WebSocket's sends are ``async`` (the ASGI ``send``, the server's batch sender), yet
nearly every one completes without waiting: the transport's buffer has room, the bytes go
to the kernel, the coroutine returns. Awaited in a task, each such send still costs a task
wake (a future, a callback, a step of the task) per message per socket: about a tenth of
the server's CPU at 100 token streams, one socket each (``bench/transports.py``).
:func:`start_eagerly` runs the coroutine at once instead, as Python 3.12's eager tasks do
(``asyncio.eager_task_factory``): if it completes, that is all; if it has to wait (a full
buffer), what is left of it is returned, for a task to await.

Nothing here knows about WebSockets: it steps a coroutine by the protocol every coroutine
speaks (``send``, ``throw``, ``close``), and hands the future it waits on to the awaiting
task unchanged, so the task's loop, cancellation and timeouts see an ordinary await.
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine, Generator
from types import CoroutineType
from typing import Any

__all__ = ["Rest", "start_eagerly"]


class Rest:
    """What is left of a coroutine that had to wait: await it (once) to finish it, or
    :meth:`close` it to abandon it."""

    __slots__ = ("_coro", "_waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting_on: object) -> None:
        self._coro = coro
        self._waiting_on = waiting_on  # what it yielded: the future it waits on

    def __await__(self) -> Generator[Any, Any, None]:
        coro = self._coro
        value = self._waiting_on
        while True:
            try:
                sent = yield value  # the awaiting task waits on it as if awaited directly
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # cancellation, a timeout: into the coroutine
                try:
                    value = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = coro.send(sent)
                except StopIteration:
                    return

    def close(self) -> None:
        """Abandon it: its ``finally`` blocks run (a send waiting for room stops waiting)."""
        self._coro.close()


def start_eagerly(send: Awaitable[None]) -> Rest | None:
    """Run ``send`` until it completes (``None``; its exception is raised here) or first
    has to wait (what is left of it, to await)."""
    coro = send if type(send) is CoroutineType or isinstance(send, Coroutine) else _awaited(send)
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return None
    return Rest(coro, waiting_on)


async def _awaited(awaitable: Awaitable[None]) -> None:
    """Any awaitable (a future, an object with ``__await__``) as a coroutine."""
    await awaitable
