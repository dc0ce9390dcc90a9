"""The EventLog contract, run against every implementation (see ``LOG_FACTORIES``)."""

from __future__ import annotations

import asyncio

import pytest

from sluice.errors import ResumeGapError, StreamNotFoundError
from sluice.events import Finished, FinishReason, TextDelta
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
    later = log.read(SID, 1, 10)
    assert (later.first_seq, list(later.events)) == (2, [TextDelta("b"), TextDelta("c")])
    empty = log.read(SID, 3, 10)
    assert (len(empty), empty.first_seq, empty.last_seq) == (0, 4, 3)
    assert list((log.read(SID, 0, 2)).events) == [TextDelta("a"), TextDelta("b")]


async def test_a_batch_holds_the_neutral_events_themselves(make_log: LogFactory) -> None:
    """A log stores events, never wire bytes: what is read is what was appended."""
    log = make_log(LogLimits())
    await log.create(SID)
    events = [TextDelta("hi\nthere"), Finished(FinishReason.STOP)]
    await log.append(SID, events)
    batch = log.read(SID, 0, 10)
    assert list(batch.events) == events
    assert batch.__slots__ == ("first_seq", "events")


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


async def test_num_bytes_counts_the_events_held(make_log: LogFactory) -> None:
    log = make_log(LogLimits())
    await log.create(SID)
    empty = log.num_bytes(SID)
    assert empty > 0  # a log costs something before its first record
    await log.append(SID, [TextDelta("a")])
    one = log.num_bytes(SID)
    # The record holds its event object and its text, not just the text's length.
    assert one - empty > 40
    await log.append(SID, [TextDelta("b") for _ in range(99)])
    assert log.num_bytes(SID) - empty == pytest.approx(100 * (one - empty), rel=0.05)


async def test_the_byte_bound_counts_what_a_record_holds_not_its_text(
    make_log: LogFactory,
) -> None:
    """100 one-letter tokens have 100 bytes of text but hold about 120 bytes each: a
    5 kB bound keeps far fewer than 100."""
    log = make_log(LogLimits(max_records=1000, max_bytes=5_000))
    await log.create(SID)
    for _ in range(100):
        await log.append(SID, [TextDelta("a")])
    with pytest.raises(ResumeGapError) as gap:
        log.read(SID, 0, 1000)
    assert gap.value.first_retained_seq > 100 - 5_000 // 100
    assert log.num_bytes(SID) <= 5_000 + 512


async def test_trim_drops_the_oldest_records_down_to_a_size_and_keeps_the_newest(
    make_log: LogFactory,
) -> None:
    log = make_log(LogLimits())
    await log.create(SID)
    await log.append(SID, [TextDelta(f"t{i}") for i in range(100)])
    full = log.num_bytes(SID)
    log.trim(SID, full // 2)
    assert log.num_bytes(SID) <= full // 2
    with pytest.raises(ResumeGapError) as gap:
        log.read(SID, 0, 1000)
    first = gap.value.first_retained_seq
    kept = log.read(SID, first - 1, 1000)
    assert list(kept.events) == [TextDelta(f"t{i}") for i in range(first - 1, 100)]
    assert 40 <= len(kept) <= 60
    log.trim(SID, 0)
    assert list(log.read(SID, 99, 10).events) == [TextDelta("t99")]
    assert log.last_seq(SID) == 100
    await log.append(SID, [TextDelta("after")])
    assert list(log.read(SID, 100, 10).events) == [TextDelta("after")]


async def test_bytes_after_trims_are_those_of_the_records_left(make_log: LogFactory) -> None:
    """Trimming subtracts exactly what it drops: a log trimmed all along holds what an
    untrimmed copy holds once cut down to the same records."""
    trimmed = make_log(LogLimits(max_records=30, max_bytes=1 << 20))
    untrimmed = make_log(LogLimits())
    for log in (trimmed, untrimmed):
        await log.create(SID)
        for i in range(95):
            await log.append(SID, [TextDelta("x" * (i % 7)), TextDelta(str(i))])
    trimmed.trim(SID, trimmed.num_bytes(SID) - 1)
    untrimmed.trim(SID, trimmed.num_bytes(SID))
    firsts = []
    for log in (trimmed, untrimmed):
        with pytest.raises(ResumeGapError) as gap:
            log.read(SID, 0, 1)
        firsts.append(gap.value.first_retained_seq)
    assert firsts[0] == firsts[1]
    assert trimmed.num_bytes(SID) == untrimmed.num_bytes(SID)


async def test_num_bytes_and_trim_of_an_unknown_stream_raise_not_found(
    make_log: LogFactory,
) -> None:
    log = make_log(LogLimits())
    await log.create(SID)
    await log.delete(SID)
    with pytest.raises(StreamNotFoundError):
        log.num_bytes(SID)
    with pytest.raises(StreamNotFoundError):
        log.trim(SID, 0)
