"""The read deadline of one connection, on a hand-driven clock: the head's deadline runs
from the connection's start, the body's from the end of the head, a read whole cancels it,
and time during which the server was not reading does not count."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from sluice.transports.http1.deadline import ReadDeadline, ReadPhase


class _Timer:
    def __init__(self, at: float, callback: Callable[[], None]) -> None:
        self.at = at
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Clock:
    """What ReadDeadline uses of an event loop: ``call_later``, run by :meth:`advance`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[_Timer] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(self.now + delay, callback)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while due := [t for t in self.timers if not t.cancelled and t.at <= self.now]:
            timer = min(due, key=lambda t: t.at)
            self.timers.remove(timer)
            timer.callback()


def _deadline(paused: list[bool] | None = None) -> tuple[_Clock, ReadDeadline, list[ReadPhase]]:
    clock = _Clock()
    expired: list[ReadPhase] = []
    state = paused if paused is not None else [False]
    deadline = ReadDeadline(
        cast(asyncio.AbstractEventLoop, clock),
        head_s=10.0,
        body_s=30.0,
        on_expired=expired.append,
        reading_paused=lambda: state[0],
    )
    return clock, deadline, expired


def test_a_head_not_complete_within_head_s_of_connecting_expires() -> None:
    clock, deadline, expired = _deadline()
    deadline.head_begins()  # connected
    clock.advance(6.0)
    deadline.head_begins()  # its first byte: the deadline keeps running from the connection
    clock.advance(3.9)
    assert expired == []
    clock.advance(0.2)
    assert expired == [ReadPhase.HEAD]
    assert deadline.phase is ReadPhase.NONE


def test_the_body_is_due_within_body_s_of_the_head() -> None:
    clock, deadline, expired = _deadline()
    deadline.head_begins()
    clock.advance(9.0)
    deadline.head_complete()
    clock.advance(29.9)
    assert expired == []
    assert deadline.phase is ReadPhase.BODY
    clock.advance(0.2)
    assert expired == [ReadPhase.BODY]


def test_a_request_read_whole_has_no_deadline() -> None:
    clock, deadline, expired = _deadline()
    deadline.head_begins()
    deadline.head_complete()
    deadline.body_complete()
    clock.advance(3600.0)
    assert expired == []
    assert deadline.phase is ReadPhase.NONE


def test_a_kept_alive_connections_next_head_gets_a_fresh_deadline() -> None:
    clock, deadline, expired = _deadline()
    deadline.head_begins()
    deadline.head_complete()
    deadline.body_complete()
    clock.advance(100.0)  # between requests: uvicorn's keep-alive timeout, not ours
    deadline.head_begins()
    clock.advance(9.9)
    assert expired == []
    clock.advance(0.2)
    assert expired == [ReadPhase.HEAD]


def test_time_the_server_was_not_reading_does_not_count() -> None:
    paused = [True]
    clock, deadline, expired = _deadline(paused)
    deadline.head_begins()
    deadline.head_complete()
    clock.advance(95.0)  # a pipelined request waits its turn: not read
    assert expired == []
    assert deadline.phase is ReadPhase.BODY
    paused[0] = False
    clock.advance(30.0)
    assert expired == [ReadPhase.BODY]


def test_cancel_stops_every_deadline() -> None:
    clock, deadline, expired = _deadline()
    deadline.head_begins()
    deadline.cancel()
    clock.advance(100.0)
    assert expired == []
