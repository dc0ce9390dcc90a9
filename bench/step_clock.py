"""One timer that steps every live stream, the way an inference engine produces tokens.

An engine runs one step every few milliseconds and each step yields one token for EVERY
sequence in its batch; it does not run a timer per request. :class:`StepClock` is that
shape for the engine-shaped fan-out test of ``sse_fanout.py`` (``--only engine``): ONE
asyncio task, on a fixed-rate schedule of ``period_ns``, calls ``step(due_ns)`` on every
joined :class:`Stepped` in the order they joined. A stream joined between two steps gets
its first token at the next one. Late steps (an overloaded loop) run at once, none is
dropped, so the offered load stays N tokens per period whatever the server's speed, and
each token's ``due_ns`` is its step's place on the schedule (the latency test's
convention; ssebench's ``/tick`` does the same per stream).

Both servers of the test use this module unchanged: ``engine_server.py`` (``sluice
serve`` with a backend whose generations join the clock) and ``engine_peer.py`` (the
sse-starlette baseline, whose streams' queues join it). It imports nothing of Sluice.

A token's text is ``"<emit_ns> <seq> <due_ns> "``: ``emit_ns`` is ``time.monotonic_ns()``
when the step hands the token to its stream, ``seq`` counts the stream's tokens from 1,
and the trailing space keeps tokens apart when a server sends several as one event
(Sluice coalesces a lagging reader's tokens), so a client can count every one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final, Protocol

__all__ = ["STEP_PERIOD_NS", "StepClock", "Stepped", "token_text"]

# The engine: a step every 20 ms, i.e. 50 tokens/s per stream.
STEP_PERIOD_NS: Final = 20_000_000

_now_ns = time.monotonic_ns


def token_text(seq: int, due_ns: int) -> str:
    """The text of a stream's ``seq``-th token, due at ``due_ns``, stamped now."""
    return f"{_now_ns()} {seq} {due_ns} "


class Stepped(Protocol):
    """What the clock steps: one token per step; False once the stream has no more."""

    def step(self, due_ns: int) -> bool: ...


class StepClock:
    """The one timer. Its task runs while a stream is joined, and ends when none is."""

    def __init__(self, period_ns: int = STEP_PERIOD_NS) -> None:
        if period_ns <= 0:
            raise ValueError(f"period_ns must be positive, got {period_ns}")
        self._period_ns = period_ns
        self._live: dict[Stepped, None] = {}  # an ordered set: steps in joining order
        self._task: asyncio.Task[None] | None = None
        self.num_steps = 0

    @property
    def num_live(self) -> int:
        return len(self._live)

    def join(self, stream: Stepped) -> None:
        """Step ``stream`` from the next step on (call on the event loop)."""
        self._live[stream] = None
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def leave(self, stream: Stepped) -> None:
        """Stop stepping ``stream`` (idempotent)."""
        self._live.pop(stream, None)

    async def _run(self) -> None:
        period, live = self._period_ns, self._live
        due = _now_ns()
        try:
            while live:
                due += period
                delay = due - _now_ns()
                # Behind schedule (overloaded): late steps run at once, none is dropped.
                await asyncio.sleep(delay / 1e9 if delay > 0 else 0)
                self.num_steps += 1
                for stream in list(live):
                    if not stream.step(due):
                        live.pop(stream, None)
        finally:
            self._task = None  # no await since the loop's test: a join now starts a new task

    async def aclose(self) -> None:
        """Stop the timer and forget every stream."""
        self._live.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
