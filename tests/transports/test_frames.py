"""The frame cache: each event encoded once per stream's dialect, in the append, never per
reader; dropped and counted with the log's records; resumed frames cut exactly."""

from __future__ import annotations

import orjson
import pytest

from sluice.errors import BadEventIdError
from sluice.events import Finished, FinishReason, NeutralEvent, RenderMeta, Started, TextDelta
from sluice.sse import Decoder
from sluice.streams import LogLimits, MemoryEventLog
from sluice.streams.log import Batch
from sluice.transports.frames import (
    FrameCache,
    FrameEncoder,
    NativeEncoder,
    encoder_for,
    frame_source,
)

pytestmark = pytest.mark.anyio

SID = "str_frames"
EVENTS: list[NeutralEvent] = [Started("m", 1), TextDelta("a"), TextDelta("b")]
EVENTS += [Finished(FinishReason.STOP)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Counting:
    """An encoder that counts what it is asked to encode."""

    def __init__(self, inner: FrameEncoder) -> None:
        self.inner = inner
        self.num_encoded = 0

    @property
    def retry_hint(self) -> bool:
        return self.inner.retry_hint

    def encode(self, seq: int, event: NeutralEvent) -> bytes:
        self.num_encoded += 1
        return self.inner.encode(seq, event)

    def merged_tokens(self, text: str, seq: int) -> bytes | None:
        return self.inner.merged_tokens(text, seq)

    def refusal(self, code: str, message: str, after_seq: int) -> bytes:
        return self.inner.refusal(code, message, after_seq)


async def test_each_event_is_encoded_once_however_many_readers_read_it() -> None:
    cache = FrameCache()
    log = MemoryEventLog(observer=cache)
    await log.create(SID)
    counting = Counting(NativeEncoder(SID))
    cache.encode_as(SID, counting)
    await log.append(SID, EVENTS)
    assert counting.num_encoded == len(EVENTS)  # in the append, before any reader
    batch = log.read(SID, 0, 100)
    bodies = {frame_source(cache, log, SID, None, 0).body(batch) for _ in range(1000)}
    assert counting.num_encoded == len(EVENTS)
    assert len(bodies) == 1
    assert [e.id for e in Decoder().feed(bodies.pop())] == [f"{SID}:{n}" for n in range(1, 5)]


async def test_a_stream_nobody_named_an_encoder_for_is_encoded_natively() -> None:
    cache = FrameCache()
    log = MemoryEventLog(observer=cache)
    await log.create(SID)
    await log.append(SID, EVENTS)
    body = frame_source(cache, log, SID, None, 0).body(log.read(SID, 0, 100))
    events = Decoder().feed(body)
    assert [e.event for e in events] == ["start", "token", "token", "done"]
    assert orjson.loads(events[1].data) == {"text": "a"}


async def test_the_logs_bytes_count_the_frames_and_a_trim_drops_them() -> None:
    cache = FrameCache()
    plain = MemoryEventLog()
    cached = MemoryEventLog(LogLimits(max_records=10), observer=cache)
    for log in (plain, cached):
        await log.create(SID)
        await log.append(SID, [TextDelta("a")])
    assert cached.num_bytes(SID) > plain.num_bytes(SID)  # the frame is counted too
    await cached.append(SID, [TextDelta(str(i)) for i in range(30)])
    batch = cached.read(SID, cached.last_seq(SID) - 1, 1)
    frames = frame_source(cache, cached, SID, None, batch.first_seq - 1).frames(batch)
    assert Decoder().feed(frames[0])[0].id == f"{SID}:31"  # the frames moved with the trim
    await cached.delete(SID)
    assert len(cache) == 0


async def test_a_compatible_stream_resumed_from_a_frame_id_gets_only_the_frames_after_it() -> None:
    meta = RenderMeta("anthropic", "msg_1", "m", 1, resumable=True)
    cache = FrameCache()
    log = MemoryEventLog(observer=cache)
    await log.create(SID)
    cache.encode_as(SID, encoder_for(meta, SID))
    await log.append(SID, EVENTS)
    whole = Decoder().feed(frame_source(cache, log, SID, meta, 0).body(log.read(SID, 0, 100)))
    ids = [e.id for e in whole]
    assert ids[-1] == f"{SID}:4"
    # Resume after the first frame of event 1 (Started renders to several frames).
    assert ids[0] == f"{SID}:0.1"
    resumed = frame_source(cache, log, SID, meta, 0, skip=1)
    got = Decoder().feed(resumed.body(log.read(SID, 0, 100)))
    assert got == whole[1:]


async def test_a_frame_id_past_an_events_frames_is_refused_before_any_response() -> None:
    meta = RenderMeta("anthropic", "msg_1", "m", 1, resumable=True)
    cache = FrameCache()
    log = MemoryEventLog(observer=cache)
    await log.create(SID)
    cache.encode_as(SID, encoder_for(meta, SID))
    await log.append(SID, EVENTS)
    with pytest.raises(BadEventIdError, match="frame 99"):
        frame_source(cache, log, SID, meta, 0, skip=99)


async def test_a_whole_answer_read_as_sse_is_rendered_by_its_reader_from_the_start() -> None:
    """A ``"stream": false`` stream keeps no frames; a reader of it renders its own, having
    replayed the events before its position (the renderer is stateful)."""
    meta = RenderMeta("openai_chat", "chatcmpl-1", "m", 1, resumable=True)
    cache = FrameCache()
    log = MemoryEventLog(observer=cache)
    await log.create(SID)
    cache.encode_as(SID, None)
    await log.append(SID, EVENTS)
    plain = MemoryEventLog()
    await plain.create(SID)
    await plain.append(SID, EVENTS)
    assert log.num_bytes(SID) == plain.num_bytes(SID)  # no frames kept for it
    source = frame_source(cache, log, SID, meta, 2)
    got = Decoder().feed(source.body(Batch(3, EVENTS[2:])))
    contents = [orjson.loads(e.data)["choices"][0]["delta"].get("content") for e in got[:1]]
    assert contents == ["b"]
    assert got[-1].data == "[DONE]"
