"""SSE delivery logic: coalescing a lagging reader's tokens, the send timeout of the
callback-driven connection, and the kernel write deadline."""

from __future__ import annotations

import asyncio
import socket

import orjson
import pytest

from sluice.backends.base import GenerationRequest
from sluice.backends.words import WordsBackend
from sluice.dialects import native
from sluice.events import Finished, FinishReason, NeutralEvent, TextDelta, Usage
from sluice.sse import Decoder
from sluice.streams import HubSettings, MemoryEventLog, StreamHub, StreamState
from sluice.streams.ids import event_id
from sluice.streams.log import Batch
from sluice.transports.sse import SSEConnection, SSEOptions, coalesce_tokens, set_write_deadline
from tests.streams.reading import read_until_done

pytestmark = pytest.mark.anyio

STREAM = "str_test"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def batch_of(events: list[NeutralEvent], first_seq: int = 1) -> Batch:
    frames = [native.frame(e, event_id(STREAM, first_seq + i)) for i, e in enumerate(events)]
    return Batch(first_seq, events, frames)


def decoded(body: bytes) -> list[tuple[str, str, str]]:
    return [(e.event, e.id, e.data) for e in Decoder().feed(body)]


def test_coalescing_merges_each_token_run_under_the_id_of_its_last_event() -> None:
    events: list[NeutralEvent] = [
        TextDelta("a"),
        TextDelta("b"),
        TextDelta("c"),
        Usage(1, 3),
        TextDelta("d"),
        Finished(FinishReason.STOP),
    ]
    body, num_merged = coalesce_tokens(batch_of(events, first_seq=5), STREAM)
    assert num_merged == 2
    assert decoded(body) == [
        ("token", f"{STREAM}:7", '{"text":"abc"}'),
        decoded(native.frame(events[3], f"{STREAM}:8"))[0],
        ("token", f"{STREAM}:9", '{"text":"d"}'),  # a run of one keeps its frame
        decoded(native.frame(events[5], f"{STREAM}:10"))[0],
    ]


def test_coalescing_a_batch_without_runs_changes_nothing() -> None:
    events: list[NeutralEvent] = [TextDelta("x"), Usage(1, 1), Finished(FinishReason.STOP)]
    batch = batch_of(events)
    assert coalesce_tokens(batch, STREAM) == (b"".join(batch.frames), 0)


def test_write_deadline_is_set_on_a_tcp_socket() -> None:
    with socket.socket() as sock:
        assert set_write_deadline(sock, 1.5)
        option = socket.TCP_USER_TIMEOUT
        assert sock.getsockopt(socket.IPPROTO_TCP, option) == 1500


class FakeTransport:
    """What the HTTP layer gives a connection: writes collected, finish recorded."""

    def __init__(self) -> None:
        self.body = b""
        self.finished: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def write(self, data: bytes) -> None:
        self.body += data

    def finish(self, clean: bool) -> None:
        self.finished.set_result(clean)


async def test_connection_paused_past_the_send_timeout_is_closed_and_cancels_its_stream() -> None:
    """The stuck reader of a non-resumable stream: the connection ends unclean, its reader
    leaves, and the hub cancels the stream (no model slot stays pinned)."""
    hub = StreamHub(MemoryEventLog(), {"words": WordsBackend()}, HubSettings())
    async with hub.running():
        request = GenerationRequest(" ".join(["w"] * 10_000), interval_s=0.01)
        stream = await hub.create("words", request, resumable=False)
        transport = FakeTransport()
        options = SSEOptions(heartbeat_interval_s=10, send_timeout_s=0.2)
        connection = SSEConnection(
            hub.open_reader(stream.id, 0), options, write=transport.write, finish=transport.finish
        )
        connection.start()
        connection.pause_writing()  # the client stops reading
        assert await asyncio.wait_for(transport.finished, 5) is False
        assert connection.closed
        assert not stream.readers
        events = await read_until_done(hub.open_reader(stream.id, 0))
        assert events[-1] == Finished(FinishReason.CANCELLED)
        assert stream.state is StreamState.CANCELLED


async def test_connection_that_drains_in_time_is_kept_and_its_backlog_arrives_coalesced() -> None:
    hub = StreamHub(MemoryEventLog(), {"words": WordsBackend()}, HubSettings())
    async with hub.running():
        words = [f"w{i}" for i in range(200)]
        stream = await hub.create("words", GenerationRequest(" ".join(words)))
        transport = FakeTransport()
        options = SSEOptions(heartbeat_interval_s=10, send_timeout_s=5)
        connection = SSEConnection(
            hub.open_reader(stream.id, 0), options, write=transport.write, finish=transport.finish
        )
        connection.pause_writing()  # paused before anything is written
        connection.start()
        await read_until_done(hub.open_reader(stream.id, 0))  # the producer is done
        connection.resume_writing()
        assert await asyncio.wait_for(transport.finished, 5) is True
        events = Decoder().feed(transport.body)
        tokens = [e for e in events if e.event == "token"]
        assert "".join(orjson.loads(e.data)["text"] for e in tokens).split() == words
        assert len(tokens) < len(words)
        assert events[-1].event == "done"
        assert events[-1].id == f"{stream.id}:{len(words) + 3}"
