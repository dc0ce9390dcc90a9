"""The sans-IO delivery core: what one connection is written, told only what happened.

No loop, socket or timer: each test feeds the core inputs with an explicit ``now`` and
asserts the bytes it answers and what it says to do next.
"""

from __future__ import annotations

import orjson
import pytest

from sluice.events import (
    Finished,
    FinishReason,
    NeutralEvent,
    RenderMeta,
    Started,
    TextDelta,
    Usage,
)
from sluice.grpc_api import streams_pb2 as pb
from sluice.grpc_api.messages import GrpcFrames, split_frames
from sluice.sse import Decoder, Event
from sluice.streams import LogLimits, MemoryEventLog, Reader
from sluice.transports.delivery import PING, Delivery, DeliveryOptions, Ending
from sluice.transports.frames import FrameCache, encoder_for, frame_source

pytestmark = pytest.mark.anyio

SID = "str_delivery"
OPTIONS = DeliveryOptions(heartbeat_interval_s=10.0, send_timeout_s=5.0, retry_ms=700)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Observed:
    """The hub's delivery observer, recorded."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.num_timeouts = 0
        self.num_coalesced = 0

    def send_timed_out(self) -> None:
        self.num_timeouts += 1

    def coalesced_events(self, count: int) -> None:
        self.num_coalesced += count

    def token_write_gap(self, model: str, gap_s: float) -> None:
        self.gaps.append(gap_s)


class Setup:
    """A log with the frame cache, one stream, and a reader of it."""

    def __init__(self, meta: RenderMeta | None = None, limits: LogLimits | None = None) -> None:
        self.cache = FrameCache()
        self.log = MemoryEventLog(limits, observer=self.cache)
        self.meta = meta
        self.closed: list[Reader] = []
        self.observed = Observed()

    async def start(self) -> None:
        await self.log.create(SID)
        if self.meta is not None:
            self.cache.encode_as(SID, encoder_for(self.meta, SID))

    def delivery(self, after_seq: int = 0, options: DeliveryOptions = OPTIONS) -> Delivery:
        reader = Reader(self.log, SID, after_seq, on_close=self.closed.append, model="m")
        reader.delivery = self.observed
        frames = frame_source(self.cache, self.log, SID, self.meta, after_seq)
        return Delivery(reader, frames, options)


def decoded(body: bytes) -> list[Event]:
    return Decoder().feed(body)


def token(text: str, seq: int) -> Event:
    return Event(data=orjson.dumps({"text": text}).decode(), event="token", id=f"{SID}:{seq}")


STARTED = Started("m", 1)


async def test_start_writes_the_retry_hint_then_what_is_ready_then_waits() -> None:
    setup = Setup()
    await setup.start()
    await setup.log.append(SID, [STARTED, TextDelta("a"), TextDelta("b")])
    core = setup.delivery()
    body = core.start(now=0.0)
    assert body.startswith(b"retry: 700\n\n")
    assert [e.id for e in decoded(body)] == [f"{SID}:1", f"{SID}:2", f"{SID}:3"]
    assert core.waiting
    assert core.ended is None
    assert core.wake_at == 10.0  # the next heartbeat


async def test_a_connection_that_keeps_up_gets_one_event_per_token() -> None:
    setup = Setup()
    await setup.start()
    core = setup.delivery()
    core.start(0.0)
    bodies = []
    for i, text in enumerate(["a", "b", "c"]):
        await setup.log.append(SID, [TextDelta(text)])
        bodies.append(core.on_records(float(i + 1)))
    assert [decoded(b) for b in bodies] == [[token("a", 1)], [token("b", 2)], [token("c", 3)]]
    assert setup.observed.gaps == [1.0, 1.0]  # one per write with tokens, from the second


async def test_a_lagging_connection_gets_each_token_run_as_one_event_under_its_last_id() -> None:
    setup = Setup()
    await setup.start()
    core = setup.delivery()
    core.start(0.0)
    core.on_paused(1.0)  # the client stopped reading
    assert core.on_records(1.5) == b""  # a paused sink is written nothing
    events: list[NeutralEvent] = [TextDelta("a"), TextDelta("b"), TextDelta("c")]
    events += [Usage(1, 4), TextDelta("d"), Finished(FinishReason.STOP)]
    await setup.log.append(SID, events)
    core.on_resumed(2.0)
    got = decoded(core.on_records(2.0))
    assert got[0] == token("abc", 3)
    assert got[1].event == "usage"
    assert got[1].id == f"{SID}:4"
    assert got[2] == token("d", 5)  # a run of one keeps its own frame
    assert got[3].event == "done"
    assert got[3].id == f"{SID}:6"
    assert setup.observed.num_coalesced == 2
    assert core.ended is Ending.CLEAN
    assert setup.closed  # ending closes the reader


async def test_a_lagging_grpc_reader_gets_each_token_run_as_one_message_under_its_last_id() -> None:
    setup = Setup()
    await setup.start()
    reader = Reader(setup.log, SID, 0, on_close=setup.closed.append, model="m")
    core = Delivery(reader, GrpcFrames(SID), OPTIONS)
    core.start(0.0)
    core.on_paused(1.0)  # a send had to wait
    core.on_resumed(1.0)
    await setup.log.append(SID, [TextDelta("a"), TextDelta("b"), Usage(1, 2), TextDelta("c")])
    got = [pb.StreamEvent.FromString(m) for m in split_frames(core.on_records(2.0))]
    assert [(m.id, m.event, m.token.text) for m in got] == [
        (f"{SID}:2", "token", "ab"),
        (f"{SID}:3", "usage", ""),
        (f"{SID}:4", "token", "c"),
    ]


async def test_heartbeat_after_an_interval_of_silence_and_never_while_paused() -> None:
    setup = Setup()
    await setup.start()
    core = setup.delivery()
    core.start(0.0)
    assert core.on_timer(9.9) == b""
    assert core.on_timer(10.0) == PING
    assert core.wake_at == 20.0
    core.on_paused(12.0)
    assert core.wake_at == 17.0  # the send timeout, not the heartbeat
    assert core.on_timer(16.9) == b""
    assert core.ended is None


async def test_a_sink_paused_past_the_send_timeout_ends_unclean_and_its_reader_leaves() -> None:
    setup = Setup()
    await setup.start()
    core = setup.delivery()
    core.start(0.0)
    core.on_paused(1.0)
    assert core.on_timer(6.0) == b""
    assert core.ended is Ending.UNCLEAN
    assert setup.observed.num_timeouts == 1
    assert len(setup.closed) == 1


async def test_a_sink_that_drains_in_time_is_kept() -> None:
    setup = Setup()
    await setup.start()
    core = setup.delivery()
    core.start(0.0)
    core.on_paused(1.0)
    core.on_resumed(5.9)
    assert core.on_timer(6.0) == b""
    assert core.ended is None
    assert core.wake_at == 10.0


async def test_a_position_the_log_no_longer_holds_gets_the_in_band_resume_gap() -> None:
    setup = Setup(limits=LogLimits(max_records=10))
    await setup.start()
    core = setup.delivery()
    await setup.log.append(SID, [TextDelta(str(i)) for i in range(30)])
    got = decoded(core.start(0.0))
    assert [e.event for e in got] == ["error"]
    assert orjson.loads(got[0].data)["code"] == "resume_gap"
    assert got[0].id == f"{SID}:0"  # its position: a reconnect names it and is refused
    assert core.ended is Ending.CLEAN


async def test_an_interrupt_ends_clean_on_the_next_event_boundary() -> None:
    setup = Setup()
    await setup.start()
    core = setup.delivery()
    core.start(0.0)
    core.interrupt()
    assert core.ended is None  # a watching shell is woken, then ends it
    assert core.on_records(1.0) == b""
    assert core.ended is Ending.CLEAN


async def test_an_interrupt_cuts_a_paused_sink_at_once() -> None:
    setup = Setup()
    await setup.start()
    core = setup.delivery()
    core.start(0.0)
    core.on_paused(1.0)
    core.interrupt()
    assert core.ended is Ending.UNCLEAN


async def test_a_compatible_dialects_frames_are_never_merged_and_carry_no_retry_hint() -> None:
    meta = RenderMeta("openai_chat", "chatcmpl-1", "m", 1, resumable=False)
    setup = Setup(meta)
    await setup.start()
    core = setup.delivery()
    assert core.start(0.0) == b""
    core.on_paused(1.0)
    await setup.log.append(SID, [STARTED, TextDelta("a"), TextDelta("b")])
    core.on_resumed(2.0)
    got = decoded(core.on_records(2.0))
    contents = [orjson.loads(e.data)["choices"][0]["delta"].get("content") for e in got]
    assert contents[-2:] == ["a", "b"]  # one chunk per token, as rendered
    assert all(e.id == "" for e in got)  # not resumable: no ids
    assert setup.observed.num_coalesced == 0


def test_options_refuse_impossible_values() -> None:
    for bad in (
        {"heartbeat_interval_s": 0.0},
        {"send_timeout_s": 0.0},
        {"max_batch_records": 0},
        {"retry_ms": -1},
    ):
        with pytest.raises(ValueError, match="must"):
            DeliveryOptions(**bad)  # type: ignore[arg-type]
