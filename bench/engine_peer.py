"""The sse-starlette baseline of the engine-shaped fan-out test: one timer feeds every stream.

Our own code, beside the vendored ssebench peers (``ssebench/peers/asgi_apps.py``, which
run a timer per stream): a Starlette app whose ``/engine?count=K`` streams K tokens through
sse-starlette's ``EventSourceResponse`` (library defaults, as ssebench's peer a.). Each
stream is an ``asyncio.Queue`` that ONE :class:`step_clock.StepClock` (the same module the
Sluice side uses) fills with the stream's next token ``"<emit_ns> <seq> <due_ns> "`` every
20 ms; the response's generator yields each token as it is taken from the queue, and ends
after the K-th (``count=0``: until the client leaves). The clock lives in the app's
lifespan. ``/`` answers ``ok`` for health checks.

Run (from ``bench/``): ``python -m uvicorn --app-dir . engine_peer:app --port 18081
--loop uvloop --http httptools``
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from step_clock import StepClock, token_text

__all__ = ["app"]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # as ssebench's peers


class Feed:
    """One stream's queue of tokens, filled by the clock."""

    __slots__ = ("count", "queue", "seq")

    def __init__(self, count: int) -> None:
        self.count = count
        self.seq = 0
        # At most ``count`` items: the clock stops stepping a feed after its last token.
        self.queue: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()

    def step(self, due_ns: int) -> bool:
        self.seq += 1
        last = self.seq == self.count
        self.queue.put_nowait((token_text(self.seq, due_ns), last))
        return not last


async def _tokens(clock: StepClock, feed: Feed) -> AsyncIterator[str]:
    clock.join(feed)
    try:
        while True:
            text, last = await feed.queue.get()
            yield text  # sse-starlette frames it as "data: <text>\r\n\r\n"
            if last:
                return
    finally:
        clock.leave(feed)


async def engine(request: Request) -> EventSourceResponse:
    try:
        count = max(0, int(request.query_params.get("count", "0")))
    except ValueError:
        count = 0
    clock: StepClock = request.app.state.clock
    return EventSourceResponse(_tokens(clock, Feed(count)), headers=SSE_HEADERS)


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    app.state.clock = StepClock()
    try:
        yield
    finally:
        await app.state.clock.aclose()


app = Starlette(routes=[Route("/", health), Route("/engine", engine)], lifespan=lifespan)
