"""One WebSocket's shell (:class:`~sluice.transports.websocket.WebSocketSession`) on a raw
ASGI harness: an in-memory log, a ``send`` the test can stall, a ``receive`` it feeds.

What a real server cannot show a stuck client (it never reads): the queue's bound, the
pause and coalescing, the close code sent after the send timeout, and the receiver reading
no client message while the queue is full.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from sluice.events import Finished, FinishReason, Started, TextDelta
from sluice.streams import MemoryEventLog, Reader
from sluice.transports.asgi import Message
from sluice.transports.delivery import DeliveryOptions
from sluice.transports.websocket import SEND_TEXTS, WebSocketSession
from sluice.transports.websocket_protocol import WebSocketLimits, error_message

pytestmark = pytest.mark.anyio

SID = "str_" + "S" * 22
LIMITS = WebSocketLimits(max_queued_messages=16, resume_queued_messages=4, close_timeout_s=0.1)
OPTIONS = DeliveryOptions(heartbeat_interval_s=60.0, send_timeout_s=0.3, max_batch_records=8)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["asgi-send", "batch-send"])
def batched(request: pytest.FixtureRequest) -> bool:
    """Each test twice: messages sent one ASGI ``websocket.send`` each, and in batches
    through the server's :data:`~sluice.transports.websocket.SEND_TEXTS` extension."""
    return bool(request.param == "batch-send")


class Socket:
    """The ASGI side of one WebSocket: what was sent, a gate that stalls sends, and the
    client's messages; ``batched``, its scope offers the batch sender, which takes a whole
    batch (or none of it) at the gate."""

    def __init__(self, batched: bool) -> None:
        self.scope: dict[str, Any] = {"type": "websocket", "extensions": {}}
        if batched:
            self.scope["extensions"][SEND_TEXTS] = {"send": self.send_texts}
        self.sent: list[Message] = []
        self.attempted: list[Message] = []  # every send asked for, taken or not
        self.batch_sizes: list[int] = []  # the messages of each batch send asked for
        self.gate = asyncio.Event()
        self.gate.set()
        self.incoming: asyncio.Queue[Message] = asyncio.Queue()
        self.handled: list[str] = []

    async def send(self, message: Message) -> None:
        self.attempted.append(message)
        await self.gate.wait()
        self.sent.append(message)

    async def send_texts(self, texts: list[bytes]) -> None:
        messages = [{"type": "websocket.send", "text": text.decode()} for text in texts]
        self.batch_sizes.append(len(messages))
        self.attempted.extend(messages)
        await self.gate.wait()
        self.sent.extend(messages)

    async def receive(self) -> Message:
        return await self.incoming.get()

    async def handle(self, session: WebSocketSession, text: str) -> None:
        self.handled.append(text)
        session.send_message(error_message("seen", text))

    def events(self) -> list[dict[str, Any]]:
        texts = [m["text"] for m in self.sent if m["type"] == "websocket.send"]
        return [m for m in map(orjson.loads, texts) if m["type"] == "event"]


async def until(what: str, condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.005)  # polling an observable condition with a deadline


async def a_log(num_tokens: int, *, end: bool = True) -> MemoryEventLog:
    log = MemoryEventLog()
    await log.create(SID)
    await log.append(SID, [Started("m", 1), *(TextDelta(f" t{i}") for i in range(num_tokens))])
    if end:
        await log.append(SID, [Finished(FinishReason.STOP)])
    return log


def reader_of(log: MemoryEventLog, closed: list[Reader], after_seq: int = 0) -> Reader:
    return Reader(log, SID, after_seq, on_close=closed.append)


async def test_a_draining_socket_gets_every_token_once_coalesced_while_it_lagged(
    batched: bool,
) -> None:
    socket = Socket(batched)
    socket.gate.clear()  # stuck at first
    log = await a_log(200)
    closed: list[Reader] = []
    session = WebSocketSession(socket.scope, socket.send, OPTIONS, LIMITS)
    serving = asyncio.create_task(session.serve(socket.receive, socket.handle))
    session.subscribe(reader_of(log, closed), resumable=True)
    await until("the queue is full", lambda: session.num_queued >= LIMITS.max_queued_messages)
    # Bounded: the bound, plus at most one delivery batch of the one subscription.
    assert session.num_queued <= LIMITS.max_queued_messages + OPTIONS.max_batch_records
    socket.gate.set()
    await until("the terminal event went out", lambda: any(
        e["event"] == "done" for e in socket.events()
    ))  # fmt: skip
    events = socket.events()
    tokens = [e for e in events if e["event"] == "token"]
    assert "".join(e["data"]["text"] for e in tokens) == "".join(f" t{i}" for i in range(200))
    assert len(tokens) < 200  # the lagging subscription's missed tokens, merged
    seqs = [int(e["id"].rsplit(":", 1)[1]) for e in events]
    assert seqs == sorted(set(seqs))  # in order, none twice (a merged run has its last id)
    assert closed  # the subscription ended with the stream, and its reader left
    socket.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
    await serving
    assert not any(m["type"] == "websocket.close" for m in socket.attempted)


@pytest.mark.parametrize(("resumable", "code"), [(True, 1013), (False, 1008)])
async def test_a_stuck_socket_is_closed_after_the_send_timeout(
    resumable: bool, code: int, batched: bool
) -> None:
    socket = Socket(batched)
    socket.gate.clear()  # never drains
    log = await a_log(200, end=False)
    closed: list[Reader] = []
    session = WebSocketSession(socket.scope, socket.send, OPTIONS, LIMITS)
    began = time.monotonic()
    serving = asyncio.create_task(session.serve(socket.receive, socket.handle))
    session.subscribe(reader_of(log, closed), resumable=resumable)
    await asyncio.wait_for(serving, timeout=10)
    assert time.monotonic() - began >= OPTIONS.send_timeout_s
    assert len(closed) == 1  # its reader left: the hub cancels or starts the grace window
    assert socket.attempted[-1] == {"type": "websocket.close", "code": code}


async def test_the_receiver_reads_no_client_message_while_the_queue_is_full(batched: bool) -> None:
    socket = Socket(batched)
    socket.gate.clear()
    log = await a_log(100, end=False)
    session = WebSocketSession(socket.scope, socket.send, OPTIONS, LIMITS)
    serving = asyncio.create_task(session.serve(socket.receive, socket.handle))
    session.subscribe(reader_of(log, []), resumable=True)
    await until("the queue is full", lambda: session.num_queued >= LIMITS.max_queued_messages)
    socket.incoming.put_nowait({"type": "websocket.receive", "text": "hello"})
    await asyncio.sleep(0.05)  # the subject: time in which a reader would have read it
    assert socket.handled == []
    socket.gate.set()
    await until("the message was handled", lambda: socket.handled == ["hello"])
    socket.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
    await serving


async def test_a_binary_message_is_refused_and_the_socket_reads_on(batched: bool) -> None:
    socket = Socket(batched)
    session = WebSocketSession(socket.scope, socket.send, OPTIONS, LIMITS)
    serving = asyncio.create_task(session.serve(socket.receive, socket.handle))
    socket.incoming.put_nowait({"type": "websocket.receive", "bytes": b"\x00"})
    socket.incoming.put_nowait({"type": "websocket.receive", "text": "next"})
    await until("the text was handled", lambda: socket.handled == ["next"])
    socket.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
    await serving
    answers = [orjson.loads(m["text"]) for m in socket.sent if m["type"] == "websocket.send"]
    assert answers[0]["code"] == "invalid_request"
    assert answers[1] == {"type": "error", "code": "seen", "message": "next"}


async def test_closing_the_socket_detaches_every_subscription(batched: bool) -> None:
    socket = Socket(batched)
    log = await a_log(3, end=False)
    closed: list[Reader] = []
    session = WebSocketSession(socket.scope, socket.send, OPTIONS, LIMITS)
    serving = asyncio.create_task(session.serve(socket.receive, socket.handle))
    session.subscribe(reader_of(log, closed), resumable=True)
    await until("caught up", lambda: len(socket.events()) == 4)
    assert closed == []
    socket.incoming.put_nowait({"type": "websocket.disconnect", "code": 1001})
    await serving
    assert len(closed) == 1
    assert session.num_streams == 0


async def test_messages_queued_while_a_send_waits_follow_it_in_order_in_one_write(
    batched: bool,
) -> None:
    socket = Socket(batched)
    socket.gate.clear()
    session = WebSocketSession(socket.scope, socket.send, OPTIONS, LIMITS)
    serving = asyncio.create_task(session.serve(socket.receive, socket.handle))
    session.send_message(error_message("first", "1"))
    await until("the first send waits", lambda: len(socket.attempted) == 1)
    session.send_message(error_message("second", "2"))
    session.send_message(error_message("third", "3"))
    await asyncio.sleep(0.02)  # the subject: passes in which nothing else may be sent
    assert len(socket.attempted) == 1
    socket.gate.set()
    await until("all went out", lambda: len(socket.sent) == 3)
    codes = [orjson.loads(m["text"])["code"] for m in socket.sent]
    assert codes == ["first", "second", "third"]
    if batched:
        assert socket.batch_sizes == [1, 2]
    socket.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
    await serving


async def test_a_send_that_fails_unexpectedly_is_raised_by_serve() -> None:
    socket = Socket(batched=True)

    async def broken(texts: list[bytes]) -> None:
        raise RuntimeError("messages before websocket.accept")

    socket.scope["extensions"][SEND_TEXTS] = {"send": broken}
    session = WebSocketSession(socket.scope, socket.send, OPTIONS, LIMITS)
    serving = asyncio.create_task(session.serve(socket.receive, socket.handle))
    session.send_message(error_message("first", "1"))
    with pytest.raises(RuntimeError, match=r"before websocket\.accept"):
        await asyncio.wait_for(serving, timeout=5)
