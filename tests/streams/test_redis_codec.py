"""Neutral events as a Redis log stores and publishes them: every kind survives the trip."""

from __future__ import annotations

import pytest

from sluice.events import (
    Error,
    Finished,
    FinishReason,
    NeutralEvent,
    Payload,
    Started,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from sluice.streams.redis_codec import decode_append, decode_event, encode_append, encode_event

EVERY_KIND: list[NeutralEvent] = [
    Started("m", 1_700_000_000, 12),
    TextDelta('a "quoted"\nline ☃'),
    ToolCallDelta(0, '{"x":', "call_1", "lookup"),
    ToolCallDelta(1, "1}", None, None),
    Usage(12, 3, 4),
    Finished(FinishReason.STOP, "END"),
    Finished(FinishReason.LENGTH, None),
    Error("unavailable", "the producer is gone", True),
    Payload(b'{"a":1},{"b":[2]}', 2),
    Payload(bytes(range(256))),  # a binary durable stream's append
]


@pytest.mark.parametrize("event", EVERY_KIND, ids=lambda e: type(e).__name__)
def test_each_event_decodes_to_itself(event: NeutralEvent) -> None:
    assert decode_event(encode_event(event)) == event


def test_a_published_append_carries_its_first_seq_and_events_in_order() -> None:
    data = encode_append(41, [encode_event(event) for event in EVERY_KIND])
    assert decode_append(data) == (41, EVERY_KIND)


def test_an_unknown_tag_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown event tag"):
        decode_event(b'["z", 1]')
