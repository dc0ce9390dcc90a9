"""Round trips: whatever the encoder writes, the decoder reads back, however it is split.

The expectations follow WHATWG HTML §9.2.6:

- ``data`` comes back with every CRLF and lone CR turned into LF: all three end a line on
  the wire, and the decoder joins ``data`` lines with LF (``"a\\r\\nb"`` reads ``"a\\nb"``).
- The event type is ``"message"`` when none was given or an empty one was (step 6).
- The id is the most recent id given so far, ``""`` before any (the last event ID buffer
  is never reset, step 1).
- Comments and ``retry`` frames produce no events; ``retry_ms`` is the last one written.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.sse import Decoder, Event, encode_comment, encode_event, encode_retry


@dataclass(frozen=True)
class EventFrame:
    data: str
    event: str | None
    id: str | None


@dataclass(frozen=True)
class CommentFrame:
    text: str


@dataclass(frozen=True)
class RetryFrame:
    retry_ms: int


Frame = EventFrame | CommentFrame | RetryFrame

# Characters the encoder can write (no lone surrogates), with line ends and the
# characters the wire format gives meaning to drawn often.
any_char = st.characters(exclude_categories=["Cs"])
wire_char = st.sampled_from(["\r", "\n", ":", " ", "\ufeff", "\0"])
any_text = st.text(alphabet=st.one_of(wire_char, any_char))
one_line_text = st.text(alphabet=st.one_of(wire_char, any_char).filter(lambda c: c not in "\r\n"))
id_text = st.text(alphabet=st.one_of(wire_char, any_char).filter(lambda c: c not in "\r\n\0"))

event_frames = st.builds(
    EventFrame,
    data=any_text,
    event=st.none() | one_line_text,
    id=st.none() | id_text,
)
frames = st.lists(
    st.one_of(
        event_frames,
        st.builds(CommentFrame, text=any_text),
        st.builds(RetryFrame, retry_ms=st.integers(min_value=0, max_value=2**64 - 1)),
    ),
    max_size=20,
)


def _encode(frame: Frame) -> bytes:
    if isinstance(frame, EventFrame):
        return encode_event(frame.data, event=frame.event, id=frame.id)
    if isinstance(frame, CommentFrame):
        return encode_comment(frame.text)
    return encode_retry(frame.retry_ms)


def _expected(written: list[Frame]) -> tuple[list[Event], str, int | None]:
    events: list[Event] = []
    last_id = ""
    retry_ms: int | None = None
    for frame in written:
        if isinstance(frame, EventFrame):
            if frame.id is not None:
                last_id = frame.id
            data = frame.data.replace("\r\n", "\n").replace("\r", "\n")
            events.append(Event(data, frame.event or "message", last_id))
        elif isinstance(frame, RetryFrame):
            retry_ms = frame.retry_ms
    return events, last_id, retry_ms


@given(written=frames)
def test_roundtrip_decodes_what_was_encoded(written: list[Frame]) -> None:
    decoder = Decoder()
    events = decoder.feed(b"".join(_encode(frame) for frame in written))
    events += decoder.close()
    assert (events, decoder.last_event_id, decoder.retry_ms) == _expected(written)


@given(data=any_text)
def test_roundtrip_single_event_data(data: str) -> None:
    expected = Event(data.replace("\r\n", "\n").replace("\r", "\n"))
    assert Decoder().feed(encode_event(data)) == [expected]


def test_roundtrip_empty_data() -> None:
    assert Decoder().feed(encode_event("")) == [Event("")]


def _split(stream: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(set(cuts)), len(stream)]
    return [stream[lo:hi] for lo, hi in itertools.pairwise(bounds)]


@settings(deadline=None)
@given(written=frames, draw=st.data())
def test_roundtrip_chunking_does_not_change_events(
    written: list[Frame], draw: st.DataObject
) -> None:
    stream = b"".join(_encode(frame) for frame in written)
    cuts = draw.draw(st.lists(st.integers(min_value=0, max_value=len(stream))))
    decoder = Decoder()
    events: list[Event] = []
    for chunk in _split(stream, cuts):
        events += decoder.feed(chunk)
    events += decoder.close()
    assert (events, decoder.last_event_id, decoder.retry_ms) == _expected(written)


# Arbitrary bytes, rich in the bytes the format cares about (line ends, colon, space,
# the BOM's and invalid UTF-8 bytes).
wire_bytes = st.lists(
    st.one_of(
        st.sampled_from([b"\r", b"\n", b"\r\n", b":", b" ", b"\xef\xbb\xbf", b"\xff", b"\xe2\x82"]),
        st.sampled_from([b"data", b"event", b"id", b"retry", b"12", b"\x00"]),
        st.binary(max_size=4),
    ),
    max_size=40,
).map(b"".join)


@settings(deadline=None)
@given(stream=wire_bytes, draw=st.data())
def test_decoder_any_bytes_any_chunking_match_one_feed(stream: bytes, draw: st.DataObject) -> None:
    whole = Decoder()
    expected = whole.feed(stream) + whole.close()
    cuts = draw.draw(st.lists(st.integers(min_value=0, max_value=len(stream))))
    chunked = Decoder()
    events: list[Event] = []
    for chunk in _split(stream, cuts):
        events += chunked.feed(chunk)
    events += chunked.close()
    assert events == expected
    assert (chunked.last_event_id, chunked.retry_ms) == (whole.last_event_id, whole.retry_ms)
