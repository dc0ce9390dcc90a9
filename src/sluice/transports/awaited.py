"""The delivery core driven by awaited sends: for fronts whose writes are coroutines.

Plain ASGI (:func:`sluice.transports.sse.send_event_stream`) and gRPC
(:mod:`sluice.grpc_api.service`) cannot be told when their socket drains; they learn it
by how long a send takes. :func:`pump` is their one read-else-wait loop: it writes what
the core returns, each send under the send timeout (a send that had to wait for the
socket marks the connection paused, then resumed: it is lagging, and its next read
coalesces), waits on the reader when the core is caught up, and fires the core's timer at
``wake_at``. The callback-driven native path (:class:`sluice.transports.sse.CallbackSSE`)
drives the same core without a task.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from sluice.transports.delivery import Delivery, Ending

__all__ = ["SEND_WAITED_S", "pump"]

# A send that returns later than this waited for the socket to drain (a send that does
# not wait returns within microseconds): the sink was paused.
SEND_WAITED_S = 0.002


async def pump(
    core: Delivery,
    send: Callable[[bytes], Awaitable[None]],
    *,
    send_timeout_s: float,
    gone: Callable[[], bool] = lambda: False,
) -> bool:
    """Run ``core`` from :meth:`~Delivery.start` until it ends or ``gone()`` (the peer
    left; wake the reader to make a wait notice it). True when the delivery ended clean
    with the peer still there: the front completes its response. A send that waits
    ``send_timeout_s`` ends the delivery unclean (:meth:`~Delivery.on_stalled`): the
    front then cuts the connection."""
    reader = core.reader
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(None) as deadline:
            data = core.start(time.monotonic())
            while not gone():
                if data:
                    before = loop.time()
                    deadline.reschedule(before + send_timeout_s)
                    await send(data)
                    deadline.reschedule(None)
                    if loop.time() - before > SEND_WAITED_S:
                        now = time.monotonic()
                        core.on_paused(now)
                        core.on_resumed(now)
                if core.ended is not None or gone():
                    break
                if core.waiting:
                    woke = await reader.wait(max(0.0, core.wake_at - time.monotonic()))
                    now = time.monotonic()
                    data = core.on_records(now) if woke else core.on_timer(now)
                else:
                    data = core.on_records(time.monotonic())
    except TimeoutError:
        core.on_stalled()  # the reader leaves: a non-resumable stream is cancelled
        return False
    return not gone() and core.ended is Ending.CLEAN
