"""Watching an ASGI client's disconnect: one task, under a task group.

An ASGI response learns that its client left only by reading ``receive`` (uvicorn's
``http.disconnect``), which a coroutine busy writing or waiting for records cannot do
itself. :func:`watching_disconnect` runs one watcher task for the length of a block, in a
task group (house rule 4: every task has a parent), and calls ``on_disconnect`` when the
client leaves; :func:`until_disconnect` cancels the block instead (at its current
``await``) and says whether that happened. Both stop the watcher when the block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from sluice.transports.asgi import Receive

__all__ = ["Disconnect", "until_disconnect", "watching_disconnect"]


async def _watch(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()


@contextlib.asynccontextmanager
async def watching_disconnect(
    receive: Receive, on_disconnect: Callable[[], None]
) -> AsyncIterator[None]:
    """Call ``on_disconnect`` if the client disconnects while the block runs (the request
    body must have been read before)."""
    error: Exception | None = None
    async with asyncio.TaskGroup() as group:
        watcher = group.create_task(_watch(receive, on_disconnect))
        try:
            yield
        except Exception as exc:  # re-raised below, not inside the group's ExceptionGroup
            error = exc
        finally:
            watcher.cancel()
    if error is not None:
        raise error


class Disconnect:
    """Whether the client left during an :func:`until_disconnect` block."""

    __slots__ = ("gone",)

    def __init__(self) -> None:
        self.gone = False


@contextlib.asynccontextmanager
async def until_disconnect(receive: Receive) -> AsyncIterator[Disconnect]:
    """Run the block until it ends or the client disconnects, whichever comes first: a
    disconnect cancels the block, which then ends quietly with ``gone`` set."""
    state = Disconnect()
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(None) as scope:

            def on_disconnect() -> None:
                state.gone = True
                scope.reschedule(loop.time())  # a deadline of now: cancel the block

            async with watching_disconnect(receive, on_disconnect):
                yield state
    except TimeoutError:
        if not state.gone:
            raise
