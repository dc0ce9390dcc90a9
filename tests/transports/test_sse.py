"""SSE delivery's two shells around the core: the callback-driven connection of the native
HTTP/1.1 path (send timeout, backpressure, a coalesced backlog) and the plain ASGI
coroutine (a whole stream, a client that leaves), plus the kernel write deadline."""

from __future__ import annotations

import asyncio
import socket

import orjson
import pytest

from sluice.backends.base import GenerationRequest
from sluice.backends.words import WordsBackend
from sluice.events import Finished, FinishReason
from sluice.sse import Decoder
from sluice.streams import HubSettings, MemoryEventLog, StreamHub, StreamState
from sluice.transports.asgi import Message
from sluice.transports.delivery import Delivery, DeliveryOptions
from sluice.transports.frames import FrameCache, frame_source
from sluice.transports.http1.protocol import set_write_deadline
from sluice.transports.sse import CallbackSSE, send_event_stream
from tests.streams.reading import read_until, read_until_done

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_hub() -> tuple[StreamHub, FrameCache]:
    """A hub whose log keeps the delivery layer's frames, as the app composes it."""
    cache = FrameCache()
    hub = StreamHub(MemoryEventLog(observer=cache), {"words": WordsBackend()}, HubSettings())
    return hub, cache


class FakeTransport:
    """What the HTTP layer gives a connection: writes collected, finish recorded."""

    def __init__(self) -> None:
        self.body = b""
        self.finished: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def write(self, data: bytes) -> None:
        self.body += data

    def finish(self, clean: bool) -> None:
        self.finished.set_result(clean)


def connection(
    hub: StreamHub,
    cache: FrameCache,
    stream_id: str,
    options: DeliveryOptions,
    sink: FakeTransport,
) -> CallbackSSE:
    reader = hub.open_reader(stream_id, 0)
    core = Delivery(reader, frame_source(cache, hub.log, stream_id, None, 0), options)
    return CallbackSSE(core, write=sink.write, finish=sink.finish)


def test_write_deadline_is_set_on_a_tcp_socket() -> None:
    with socket.socket() as sock:
        assert set_write_deadline(sock, 1.5)
        option = socket.TCP_USER_TIMEOUT
        assert sock.getsockopt(socket.IPPROTO_TCP, option) == 1500


async def test_connection_paused_past_the_send_timeout_is_closed_and_cancels_its_stream() -> None:
    """The stuck reader of a non-resumable stream: the connection ends unclean, its reader
    leaves, and the hub cancels the stream (no model slot stays pinned)."""
    hub, cache = make_hub()
    async with hub.running():
        request = GenerationRequest(" ".join(["w"] * 10_000), interval_s=0.01)
        stream = await hub.create("words", request, resumable=False)
        transport = FakeTransport()
        options = DeliveryOptions(heartbeat_interval_s=10, send_timeout_s=0.2)
        sse = connection(hub, cache, stream.id, options, transport)
        sse.start()
        sse.pause_writing()  # the client stops reading
        assert await asyncio.wait_for(transport.finished, 5) is False
        assert sse.closed
        assert not stream.readers
        events = await read_until_done(hub.open_reader(stream.id, 0))
        assert events[-1] == Finished(FinishReason.CANCELLED)
        assert stream.state is StreamState.CANCELLED


async def test_connection_that_drains_in_time_is_kept_and_its_backlog_arrives_coalesced() -> None:
    hub, cache = make_hub()
    async with hub.running():
        words = [f"w{i}" for i in range(200)]
        stream = await hub.create("words", GenerationRequest(" ".join(words)))
        transport = FakeTransport()
        options = DeliveryOptions(heartbeat_interval_s=10, send_timeout_s=5)
        sse = connection(hub, cache, stream.id, options, transport)
        sse.pause_writing()  # paused before anything is written
        sse.start()
        await read_until_done(hub.open_reader(stream.id, 0))  # the producer is done
        sse.resume_writing()
        assert await asyncio.wait_for(transport.finished, 5) is True
        events = Decoder().feed(transport.body)
        tokens = [e for e in events if e.event == "token"]
        assert "".join(orjson.loads(e.data)["text"] for e in tokens).split() == words
        assert len(tokens) < len(words)
        assert events[-1].event == "done"
        assert events[-1].id == f"{stream.id}:{len(words) + 3}"


class AsgiClient:
    """The ASGI side of one SSE response: what ``send`` got; ``receive`` reports a
    disconnect once ``leave`` is set."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.leave = asyncio.Event()

    async def receive(self) -> Message:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])


async def test_asgi_shell_writes_the_whole_stream_then_completes_the_response() -> None:
    hub, cache = make_hub()
    async with hub.running():
        words = [f"w{i}" for i in range(20)]
        stream = await hub.create("words", GenerationRequest(" ".join(words)))
        client = AsgiClient()
        reader = hub.open_reader(stream.id, 0)
        frames = frame_source(cache, hub.log, stream.id, None, 0)
        options = DeliveryOptions(heartbeat_interval_s=10, retry_ms=300)
        shell = send_event_stream(client.receive, client.send, reader, frames, options)
        await asyncio.wait_for(shell, 5)
        assert client.messages[0]["type"] == "http.response.start"
        assert client.messages[0]["status"] == 200
        last = {"type": "http.response.body", "body": b"", "more_body": False}
        assert client.messages[-1] == last
        assert client.body.startswith(b"retry: 300\n\n")
        events = Decoder().feed(client.body)
        tokens = [orjson.loads(e.data)["text"] for e in events if e.event == "token"]
        assert "".join(tokens).split() == words
        assert events[-1].event == "done"
        assert reader.closed


async def test_asgi_shell_ends_without_completing_when_the_client_leaves() -> None:
    """A client gone mid-stream: the shell returns, its reader leaves, and the hub cancels
    the non-resumable stream."""
    hub, cache = make_hub()
    async with hub.running():
        request = GenerationRequest(" ".join(["w"] * 10_000), interval_s=0.01)
        stream = await hub.create("words", request, resumable=False)
        client = AsgiClient()
        reader = hub.open_reader(stream.id, 0)
        frames = frame_source(cache, hub.log, stream.id, None, 0)
        options = DeliveryOptions(heartbeat_interval_s=10)
        shell = asyncio.ensure_future(
            send_event_stream(client.receive, client.send, reader, frames, options)
        )
        watcher = hub.open_reader(stream.id, 0)
        await read_until(watcher, lambda events: len(events) > 3)
        watcher.close()  # the client is the stream's only reader
        client.leave.set()
        await asyncio.wait_for(shell, 5)
        assert reader.closed
        assert not any(m.get("more_body") is False for m in client.messages)
        events = await read_until_done(hub.open_reader(stream.id, 0))
        assert events[-1] == Finished(FinishReason.CANCELLED)
        assert stream.state is StreamState.CANCELLED
