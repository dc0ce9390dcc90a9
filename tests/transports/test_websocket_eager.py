"""Sends run eagerly (:func:`~sluice.transports.websocket_eager.start_eagerly`): a send that
need not wait completes in the caller's call; one that waits is finished by whoever awaits
what is left of it, with cancellation reaching the send itself."""

from __future__ import annotations

import asyncio

import pytest

from sluice.transports.websocket_eager import Rest, start_eagerly

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Gate:
    """A send that writes to ``written`` once its gate is open."""

    def __init__(self, *, open_: bool) -> None:
        self.open = asyncio.Event()
        if open_:
            self.open.set()
        self.written: list[str] = []
        self.cleaned_up = False

    async def send(self, text: str) -> None:
        try:
            await self.open.wait()
            self.written.append(text)
        finally:
            self.cleaned_up = True


async def test_a_send_that_need_not_wait_completes_in_the_call() -> None:
    gate = Gate(open_=True)
    assert start_eagerly(gate.send("a")) is None
    assert gate.written == ["a"]  # before anything else ran on the loop


async def test_a_send_that_fails_at_once_raises_in_the_call() -> None:
    async def refused() -> None:
        raise ConnectionResetError("gone")

    with pytest.raises(ConnectionResetError):
        start_eagerly(refused())


async def test_a_send_that_waits_is_finished_by_awaiting_what_is_left() -> None:
    gate = Gate(open_=False)
    rest = start_eagerly(gate.send("a"))
    assert rest is not None
    assert gate.written == []
    finishing = asyncio.create_task(_finish(rest))
    await asyncio.sleep(0)
    assert not finishing.done()  # still waiting at the gate
    gate.open.set()
    await asyncio.wait_for(finishing, timeout=5)
    assert gate.written == ["a"]


async def test_cancelling_the_awaiting_task_cancels_the_send_itself() -> None:
    """Nothing is lost or left behind: the send's own cleanup runs, its wait is gone."""
    gate = Gate(open_=False)
    rest = start_eagerly(gate.send("a"))
    assert rest is not None
    finishing = asyncio.create_task(_finish(rest))
    await asyncio.sleep(0)
    finishing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await finishing
    assert gate.cleaned_up
    assert gate.written == []
    gate.open.set()  # would have woken a leftover waiter
    await asyncio.sleep(0)
    assert gate.written == []


async def test_closing_what_is_left_abandons_the_send() -> None:
    gate = Gate(open_=False)
    rest = start_eagerly(gate.send("a"))
    assert rest is not None
    rest.close()
    assert gate.cleaned_up
    gate.open.set()
    await asyncio.sleep(0)
    assert gate.written == []


async def test_a_future_is_waited_on_as_any_send() -> None:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    assert start_eagerly(done) is None
    pending: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    rest = start_eagerly(pending)
    assert rest is not None
    pending.set_result(None)
    await asyncio.wait_for(_finish(rest), timeout=5)


async def _finish(rest: Rest) -> None:
    await rest
