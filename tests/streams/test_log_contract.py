"""The EventLog contract, run against every implementation (see ``LOG_FACTORIES``)."""

from __future__ import annotations

import asyncio

import pytest

from sluice.errors import ResumeGapError, StreamNotFoundError
from sluice.events import Finished, FinishReason, TextDelta
from sluice.sse import Decoder, Event
from sluice.streams import LogLimits
from tests.streams.conftest import LogFactory

pytestmark = pytest.mark.anyio

SID = "str_0123456789abcdefABCDEF"


async def test_append_numbers_events_from_one_and_read_replays_after_a_position(
    make_log: LogFactory,
) -> None:
    log = make_log(LogLimits())
    await log.create(SID)
    assert log.last_seq(SID) == 0
    last = await log.append(SID, [TextDelta("a"), TextDelta("b")])
    assert last == 2
    assert await log.append(SID, [TextDelta("c")]) == 3
    batch = log.read(SID, 0, 10)
    assert (batch.first_seq, batch.last_seq) == (1, 3)
    assert list(batch.events) == [TextDelta("a"), TextDelta("b"), TextDelta("c")]
    assert len(batch.frames) == 3
    later = log.read(SID, 1, 10)
    assert (later.first_seq, list(later.events)) == (2, [TextDelta("b"), TextDelta("c")])
    empty = log.read(SID, 3, 10)
    assert (len(empty), empty.first_seq, empty.last_seq) == (0, 4, 3)
    assert list((log.read(SID, 0, 2)).events) == [TextDelta("a"), TextDelta("b")]


async def test_frames_are_native_sse_with_stream_scoped_ids(make_log: LogFactory) -> None:
    log = make_log(LogLimits())
    await log.create(SID)
    await log.append(SID, [TextDelta("hi\nthere"), Finished(FinishReason.STOP)])
    decoder = Decoder()
    events = decoder.feed(b"".join((log.read(SID, 0, 10)).frames))
    assert events == [
        Event(data='{"text":"hi\\nthere"}', event="token", id=f"{SID}:1"),
        Event(data='{"reason":"stop"}', event="done", id=f"{SID}:2"),
    ]


async def test_unknown_stream_raises_not_found(make_log: LogFactory) -> None:
    log = make_log(LogLimits())
    with pytest.raises(StreamNotFoundError):
        log.read(SID, 0, 1)
    with pytest.raises(StreamNotFoundError):
        await log.append(SID, [TextDelta("x")])


async def test_bounded_log_drops_oldest_and_reports_a_resume_gap(make_log: LogFactory) -> None:
    log = make_log(LogLimits(max_records=10, max_bytes=1 << 20))
    await log.create(SID)
    for i in range(25):
        await log.append(SID, [TextDelta(str(i))])
    batch = log.read(SID, log.last_seq(SID) - 5, 100)
    assert list(batch.events) == [TextDelta(str(i)) for i in range(20, 25)]
    with pytest.raises(ResumeGapError) as gap:
        log.read(SID, 0, 100)
    assert gap.value.first_retained_seq > 1
    retained = log.read(SID, gap.value.first_retained_seq - 1, 100)
    assert 0 < len(retained) <= 10
    assert retained.last_seq == 25
    assert len(retained.frames) == len(retained.events)


async def test_byte_bound_keeps_at_least_the_newest_record(make_log: LogFactory) -> None:
    log = make_log(LogLimits(max_records=1000, max_bytes=200))
    await log.create(SID)
    for _ in range(5):
        await log.append(SID, [TextDelta("x" * 150)])
    batch = log.read(SID, 4, 10)
    assert (batch.first_seq, len(batch)) == (5, 1)


async def test_watch_resolves_on_append_and_at_once_when_behind(make_log: LogFactory) -> None:
    log = make_log(LogLimits())
    await log.create(SID)
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    log.watch(SID, 0, waiter)
    assert not waiter.done()
    await log.append(SID, [TextDelta("a")])
    assert waiter.done()
    behind: asyncio.Future[None] = loop.create_future()
    log.watch(SID, 0, behind)
    assert behind.done()
    unwatched: asyncio.Future[None] = loop.create_future()
    log.watch(SID, 1, unwatched)
    log.unwatch(SID, unwatched)
    await log.append(SID, [TextDelta("b")])
    assert not unwatched.done()


async def test_delete_wakes_watchers_and_forgets_the_stream(make_log: LogFactory) -> None:
    log = make_log(LogLimits())
    await log.create(SID)
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    log.watch(SID, 0, waiter)
    await log.delete(SID)
    assert waiter.done()
    with pytest.raises(StreamNotFoundError):
        log.last_seq(SID)
