"""The memory estimate of a log record against what Python really allocates for it."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from sluice.dialects import native
from sluice.events import Error, Finished, FinishReason, NeutralEvent, Started, TextDelta, Usage
from sluice.streams.sizing import event_bytes, frame_bytes, record_bytes

SID = "str_0123456789abcdefABCDEF"
NUM_RECORDS = 2000


def records(make: type[TextDelta], text: str) -> tuple[list[NeutralEvent], list[bytes]]:
    # Each text a new object, as a backend makes them.
    events: list[NeutralEvent] = [make("".join([text, ""])) for _ in range(NUM_RECORDS)]
    frames = [native.frame(e, f"{SID}:{i + 1}") for i, e in enumerate(events)]
    return events, frames


@pytest.mark.parametrize("text", ["a", " hello", "x" * 40, "ééééé", "日本語", "y" * 600])
def test_token_estimate_covers_what_tracemalloc_sees_and_little_more(text: str) -> None:
    """tracemalloc reports the sizes asked for; the allocator rounds them up (16-byte
    blocks), which the estimate counts: it is at least what was asked, and within a
    third of it."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        events, frames = records(TextDelta, text)
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    estimate = sum(map(event_bytes, events)) + sum(map(frame_bytes, frames))
    assert traced <= estimate <= traced * 4 / 3


def test_other_events_are_counted_with_their_strings() -> None:
    short = event_bytes(Error("backend_error", "x"))
    long = event_bytes(Error("backend_error", "x" * 1000))
    assert long - short >= 999
    assert event_bytes(Usage(100_000, 200_000)) > event_bytes(Usage(1, 2))  # big ints
    for event in (Started("words", 1_700_000_000), Finished(FinishReason.STOP)):
        assert event_bytes(event) >= 48


@pytest.mark.parametrize("text", ["", "a", "x" * 470, "x" * 600, "é", "日本語" * 200, "🙂"])
def test_a_tokens_record_is_counted_the_same_on_the_fast_path(text: str) -> None:
    event = TextDelta(text)
    frame = native.frame(event, f"{SID}:1")
    assert record_bytes(event, frame) == event_bytes(event) + frame_bytes(frame)
    usage = Usage(3, 4)
    assert record_bytes(usage, frame) == event_bytes(usage) + frame_bytes(frame)
