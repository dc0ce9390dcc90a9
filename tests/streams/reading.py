"""Reading a stream in tests: replay, then follow live, waiting on the log (no sleeps)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sluice.events import NeutralEvent
from sluice.streams import Reader

__all__ = ["read_until", "read_until_done"]


async def read_until(
    reader: Reader, enough: Callable[[list[NeutralEvent]], bool], timeout_s: float = 10.0
) -> list[NeutralEvent]:
    """Events the reader gets until ``enough(events)`` or the stream's end."""
    events: list[NeutralEvent] = []
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout_s):
        while not reader.done and not enough(events):
            batch = reader.read(100)
            events.extend(batch.events)
            if not batch.events:
                waiter: asyncio.Future[None] = loop.create_future()
                reader.watch(waiter)
                try:
                    await waiter
                finally:
                    reader.unwatch(waiter)
    return events


async def read_until_done(reader: Reader, timeout_s: float = 10.0) -> list[NeutralEvent]:
    """Every event the reader gets until the terminal one."""
    return await read_until(reader, lambda events: False, timeout_s)
