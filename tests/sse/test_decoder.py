"""Decoder behaviour, one test per rule of WHATWG HTML §9.2.5-§9.2.6.

Every rule test takes the ``decode`` fixture and so runs four ways, as h11's readers
are tested: the whole input in one ``feed``, one byte per ``feed``, one ``feed`` per
blank-line-ended piece (the fast path's shape), and with trailing data (an incomplete event after the input, which must never appear).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from sluice.errors import ConfigError, EventTooLargeError, LineTooLongError, SSEDecodeError
from sluice.sse import DEFAULT_MAX_EVENT_CHARS, DEFAULT_MAX_LINE_BYTES, MAX_RETRY_MS, Decoder, Event

BOM = b"\xef\xbb\xbf"

# An event cut off by the end of the stream: its fields, its id included, must not show
# in the events or in ``last_event_id`` (§9.2.5: pending data is discarded at EOF). Its
# lines are short enough for the smallest ``max_line_bytes`` used below.
TRAILING_INCOMPLETE = b"id: t\nevent: t\ndata: x\n"


@dataclass(frozen=True)
class Decoded:
    events: list[Event]
    last_event_id: str
    retry_ms: int | None


Decode = Callable[..., Decoded]


def _feed_whole(decoder: Decoder, stream: bytes) -> list[Event]:
    return decoder.feed(stream)


def _feed_bytewise(decoder: Decoder, stream: bytes) -> list[Event]:
    events: list[Event] = []
    for index in range(len(stream)):
        events += decoder.feed(stream[index : index + 1])
    return events


def _feed_per_event(decoder: Decoder, stream: bytes) -> list[Event]:
    """One ``feed`` per blank-line-ended piece, as an upstream sends one event per chunk
    (the shape the decoder's fast path takes)."""
    events: list[Event] = []
    start = 0
    while (end := stream.find(b"\n\n", start)) != -1:
        events += decoder.feed(stream[start : end + 2])
        start = end + 2
    return events + decoder.feed(stream[start:])


def _feed_with_trailing(decoder: Decoder, stream: bytes) -> list[Event]:
    return decoder.feed(stream + TRAILING_INCOMPLETE)


@pytest.fixture(
    params=[_feed_whole, _feed_bytewise, _feed_per_event, _feed_with_trailing],
    ids=["whole", "bytewise", "per-event", "trailing"],
)
def decode(request: pytest.FixtureRequest) -> Decode:
    """Decode a complete stream, fed one of three ways, then closed."""
    feeder: Callable[[Decoder, bytes], list[Event]] = request.param

    def run(
        stream: bytes,
        *,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_event_chars: int = DEFAULT_MAX_EVENT_CHARS,
    ) -> Decoded:
        decoder = Decoder(max_line_bytes=max_line_bytes, max_event_chars=max_event_chars)
        events = feeder(decoder, stream)
        events += decoder.close()
        return Decoded(events, decoder.last_event_id, decoder.retry_ms)

    return run


# --- §9.2.5: byte order mark -------------------------------------------------------------


def test_decoder_strips_leading_bom(decode: Decode) -> None:
    assert decode(BOM + b"data: a\n\n").events == [Event("a")]


def test_decoder_strips_only_one_bom(decode: Decode) -> None:
    # The second BOM is content: it makes the field name "\ufeffdata", which is ignored.
    stream = BOM + BOM + b"data: a\n\ndata: b\n\n"
    assert decode(stream).events == [Event("b")]


def test_decoder_keeps_bom_after_stream_start(decode: Decode) -> None:
    stream = b"data: a\n\n" + BOM + b"data: b\n\n" + b"data: c\n\n"
    assert decode(stream).events == [Event("a"), Event("c")]


def test_decoder_keeps_bom_inside_value(decode: Decode) -> None:
    assert decode(b"data: " + BOM + b"a\n\n").events == [Event("\ufeffa")]


def test_decoder_bom_prefix_alone_yields_nothing(decode: Decode) -> None:
    assert decode(BOM[:2]).events == []


def test_decoder_bom_then_nothing_yields_nothing(decode: Decode) -> None:
    assert decode(BOM).events == []


def test_decoder_bom_split_over_feeds_is_stripped() -> None:
    decoder = Decoder()
    assert decoder.feed(b"") == []
    assert decoder.feed(b"\xef") == []
    assert decoder.feed(b"\xbb") == []
    assert decoder.feed(b"\xbfdata: a\n\n") == [Event("a")]


# --- §9.2.5: line ends -------------------------------------------------------------------


@pytest.mark.parametrize("line_end", [b"\n", b"\r", b"\r\n"], ids=["lf", "cr", "crlf"])
def test_decoder_accepts_each_line_end(decode: Decode, line_end: bytes) -> None:
    stream = b"data: a" + line_end + b"data: b" + line_end + line_end
    assert decode(stream).events == [Event("a\nb")]


def test_decoder_split_crlf_dispatches_once(decode: Decode) -> None:
    # Fed byte by byte every CR arrives alone; its LF must not count as a blank line.
    stream = b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n"
    assert decode(stream).events == [Event("a\nb"), Event("c")]


def test_decoder_crlf_split_across_feeds_is_one_line_end() -> None:
    decoder = Decoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\ndata: b\r") == []
    assert decoder.feed(b"\n\r") == [Event("a\nb")]
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"data: c\n\n") == [Event("c")]


def test_decoder_cr_at_end_of_chunk_ends_the_line_at_once() -> None:
    decoder = Decoder()
    assert decoder.feed(b"data: a\n\r") == [Event("a")]


def test_decoder_lf_then_cr_is_two_line_ends(decode: Decode) -> None:
    assert decode(b"data: a\n\rdata: b\r\r").events == [Event("a"), Event("b")]


def test_decoder_mixed_line_ends(decode: Decode) -> None:
    stream = b"data: a\rdata: b\ndata: c\r\n\rdata: d\n\r\n"
    assert decode(stream).events == [Event("a\nb\nc"), Event("d")]


def test_decoder_does_not_split_on_other_unicode_line_breaks(decode: Decode) -> None:
    text = "a\x0bb\x0cc\x1cd\x85e\u2028f\u2029g"
    assert decode(f"data: {text}\n\n".encode()).events == [Event(text)]


# --- §9.2.5: UTF-8 decode ----------------------------------------------------------------


def test_decoder_decodes_multibyte_utf8(decode: Decode) -> None:
    text = "h\u00e9llo \u4e16\u754c \U0001f642"
    stream = f"event: t\u00e9\nid: \u00e9\ndata: {text}\n\n".encode()
    assert decode(stream).events == [Event(text, "t\u00e9", "\u00e9")]


def test_decoder_replaces_invalid_utf8(decode: Decode) -> None:
    assert decode(b"data: a\xffb\n\n").events == [Event("a\ufffdb")]


def test_decoder_replaces_utf8_cut_by_line_end(decode: Decode) -> None:
    # A truncated sequence is one maximal subpart: one U+FFFD, as the Encoding Standard.
    assert decode(b"data: \xe2\x82\ndata: x\n\n").events == [Event("\ufffd\nx")]


# --- §9.2.6: blank lines, comments, field and value --------------------------------------


def test_decoder_blank_line_dispatches(decode: Decode) -> None:
    assert decode(b"data: a\n\ndata: b\n\n").events == [Event("a"), Event("b")]


def test_decoder_ignores_comment_lines(decode: Decode) -> None:
    stream = b": hello\ndata: a\n:\n:data: b\ndata: c\n\n"
    assert decode(stream).events == [Event("a\nc")]


def test_decoder_comment_only_block_dispatches_nothing(decode: Decode) -> None:
    assert decode(b": keep-alive\n\n:\n\n").events == []


def test_decoder_value_is_after_first_colon(decode: Decode) -> None:
    assert decode(b"data: a: b:c\n\n").events == [Event("a: b:c")]


def test_decoder_removes_only_one_leading_space(decode: Decode) -> None:
    stream = b"data:a\ndata: b\ndata:  c\ndata:\td\n\n"
    assert decode(stream).events == [Event("a\nb\n c\n\td")]


def test_decoder_line_without_colon_is_field_with_empty_value(decode: Decode) -> None:
    assert decode(b"data\n\n").events == [Event("")]


def test_decoder_ignores_unknown_fields(decode: Decode) -> None:
    stream = b"foo: bar\nDATA: x\n data: y\ndata : z\nretryx: 5\ndata: a\n\n"
    assert decode(stream) == Decoded([Event("a")], "", None)


# --- §9.2.6: the data field --------------------------------------------------------------


def test_decoder_joins_data_lines_with_lf(decode: Decode) -> None:
    assert decode(b"data: a\ndata: b\ndata: c\n\n").events == [Event("a\nb\nc")]


def test_decoder_empty_data_dispatches_empty_event(decode: Decode) -> None:
    assert decode(b"data: \n\ndata:\n\n").events == [Event(""), Event("")]


def test_decoder_removes_only_one_trailing_lf(decode: Decode) -> None:
    assert decode(b"data: a\ndata:\n\ndata\ndata\n\n").events == [Event("a\n"), Event("\n")]


def test_decoder_no_data_field_dispatches_nothing(decode: Decode) -> None:
    assert decode(b"event: x\n\n\n\n").events == []


# --- §9.2.6: the event field -------------------------------------------------------------


def test_decoder_event_field_sets_type(decode: Decode) -> None:
    assert decode(b"event: token\ndata: a\n\n").events == [Event("a", "token")]


def test_decoder_empty_event_type_is_message(decode: Decode) -> None:
    assert decode(b"event:\ndata: a\n\nevent\ndata: b\n\n").events == [
        Event("a"),
        Event("b"),
    ]


def test_decoder_last_event_field_wins(decode: Decode) -> None:
    assert decode(b"event: a\nevent: b\ndata: x\n\n").events == [Event("x", "b")]


def test_decoder_event_type_resets_after_dispatch(decode: Decode) -> None:
    assert decode(b"event: t\ndata: a\n\ndata: b\n\n").events == [
        Event("a", "t"),
        Event("b"),
    ]


def test_decoder_event_type_resets_when_nothing_dispatched(decode: Decode) -> None:
    assert decode(b"event: t\n\ndata: a\n\n").events == [Event("a")]


# --- §9.2.6: the id field and the last event ID ------------------------------------------


def test_decoder_id_field_sets_event_id(decode: Decode) -> None:
    assert decode(b"id: 7\ndata: a\n\n") == Decoded([Event("a", id="7")], "7", None)


def test_decoder_id_persists_across_events(decode: Decode) -> None:
    stream = b"id: 1\ndata: a\n\ndata: b\n\nid: 2\ndata: c\n\n"
    assert decode(stream) == Decoded(
        [Event("a", id="1"), Event("b", id="1"), Event("c", id="2")], "2", None
    )


def test_decoder_empty_id_resets_last_event_id(decode: Decode) -> None:
    stream = b"id: 1\ndata: a\n\nid\ndata: b\n\n"
    assert decode(stream) == Decoded([Event("a", id="1"), Event("b")], "", None)


def test_decoder_id_with_nul_is_ignored(decode: Decode) -> None:
    stream = b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n"
    assert decode(stream) == Decoded([Event("a", id="1"), Event("b", id="1")], "1", None)


def test_decoder_id_keeps_inner_spaces(decode: Decode) -> None:
    assert decode(b"id:  a b \ndata: x\n\n").events == [Event("x", id=" a b ")]


def test_decoder_id_without_data_moves_last_event_id(decode: Decode) -> None:
    # Dispatch sets the last event ID before finding the data buffer empty.
    stream = b"id: 5\n\ndata: a\n\n"
    assert decode(stream) == Decoded([Event("a", id="5")], "5", None)


def test_decoder_last_event_id_moves_only_on_dispatch() -> None:
    decoder = Decoder()
    decoder.feed(b"id: 1\ndata: a\n")
    assert decoder.last_event_id == ""
    assert decoder.feed(b"\n") == [Event("a", id="1")]
    assert decoder.last_event_id == "1"


# --- §9.2.6: the retry field -------------------------------------------------------------


def test_decoder_retry_sets_retry_ms(decode: Decode) -> None:
    assert decode(b"retry: 3000\n\n") == Decoded([], "", 3000)


def test_decoder_retry_applies_without_dispatch() -> None:
    decoder = Decoder()
    decoder.feed(b"retry: 10\n")
    assert decoder.retry_ms == 10


def test_decoder_last_retry_wins(decode: Decode) -> None:
    assert decode(b"retry: 1\nretry: 0\n\n").retry_ms == 0


def test_decoder_retry_keeps_leading_zeros_meaning(decode: Decode) -> None:
    assert decode(b"retry: " + b"0" * 5000 + b"42\n\n").retry_ms == 42


@pytest.mark.parametrize(
    "value",
    [b"", b"-1", b"+1", b"1.5", b"10a", b" 10", b"10 ", b"1e3", "\u0661\u0662".encode()],
    ids=["empty", "negative", "plus", "fraction", "suffix", "space", "trailing-space", "exp",
         "arabic-indic-digits"],
)  # fmt: skip
def test_decoder_ignores_invalid_retry(decode: Decode, value: bytes) -> None:
    # The value after "retry: " loses one space, so b" 10" is "retry:  10" -> " 10".
    stream = b"retry: 5\n\nretry: " + value + b"\ndata: a\n\n"
    assert decode(stream) == Decoded([Event("a")], "", 5)


def test_decoder_ignores_retry_above_limit(decode: Decode) -> None:
    too_big = str(MAX_RETRY_MS + 1).encode()
    stream = b"retry: 5\n" + b"retry: " + too_big + b"\nretry: " + b"9" * 5000 + b"\n\n"
    assert decode(stream).retry_ms == 5
    assert decode(b"retry: " + str(MAX_RETRY_MS).encode() + b"\n\n").retry_ms == MAX_RETRY_MS


def test_decoder_retry_does_not_dispatch(decode: Decode) -> None:
    assert decode(b"data: a\nretry: 1\n\n").events == [Event("a")]


# --- §9.2.5: end of file -----------------------------------------------------------------


def test_decoder_close_discards_incomplete_event(decode: Decode) -> None:
    stream = b"data: a\n\nid: 9\nevent: t\ndata: b\n"
    assert decode(stream) == Decoded([Event("a")], "", None)


def test_decoder_close_discards_unterminated_line(decode: Decode) -> None:
    assert decode(b"data: a\n\ndata: b\n\ndata: c").events == [Event("a"), Event("b")]


def test_decoder_close_returns_nothing_and_is_idempotent() -> None:
    decoder = Decoder()
    assert decoder.feed(b"data: a\n") == []
    assert decoder.close() == []
    assert decoder.close() == []


def test_decoder_feed_after_close_raises() -> None:
    decoder = Decoder()
    decoder.close()
    with pytest.raises(SSEDecodeError, match="after close"):
        decoder.feed(b"data: a\n\n")


def test_decoder_state_survives_close() -> None:
    decoder = Decoder()
    decoder.feed(b"retry: 7\nid: 3\ndata: a\n\n")
    decoder.close()
    assert (decoder.last_event_id, decoder.retry_ms) == ("3", 7)


def test_decoder_continues_after_many_chunks() -> None:
    decoder = Decoder()
    assert decoder.feed(b"data: a\n\nda") == [Event("a")]
    assert decoder.feed(b"ta: b\n") == []
    assert decoder.feed(b"\ndata: c\n\n") == [Event("b"), Event("c")]


# --- divergence 1: bounded lines ---------------------------------------------------------


def test_decoder_line_at_limit_is_accepted(decode: Decode) -> None:
    assert decode(b"data: abc\n\n", max_line_bytes=9).events == [Event("abc")]


def test_decoder_line_over_limit_raises(decode: Decode) -> None:
    with pytest.raises(LineTooLongError) as excinfo:
        decode(b"data: a\n\ndata: abcd\n\n", max_line_bytes=9)
    assert excinfo.value.max_line_bytes == 9


@pytest.mark.parametrize("line_end", [b"\n", b"\r", b"\r\n"], ids=["lf", "cr", "crlf"])
def test_decoder_limit_excludes_line_end(decode: Decode, line_end: bytes) -> None:
    stream = b"data: abc" + line_end + line_end
    assert decode(stream, max_line_bytes=9).events == [Event("abc")]


def test_decoder_limit_is_per_line_not_per_chunk(decode: Decode) -> None:
    stream = b"data: a\n" * 1000 + b"\n"
    assert decode(stream, max_line_bytes=8).events == [Event("\n".join("a" * 1000))]


def test_decoder_unterminated_long_line_raises_before_line_end() -> None:
    decoder = Decoder(max_line_bytes=16)
    decoder.feed(b"data: " + b"x" * 10)
    with pytest.raises(LineTooLongError):
        decoder.feed(b"x")


def test_decoder_refuses_input_after_line_too_long() -> None:
    decoder = Decoder(max_line_bytes=4)
    with pytest.raises(LineTooLongError):
        decoder.feed(b"data: a\n\n")
    with pytest.raises(SSEDecodeError, match="earlier error"):
        decoder.feed(b"\n")


@pytest.mark.parametrize("max_line_bytes", [0, -1, True, 1.5])
def test_decoder_rejects_bad_max_line_bytes(max_line_bytes: int) -> None:
    with pytest.raises(ConfigError, match="max_line_bytes"):
        Decoder(max_line_bytes=max_line_bytes)


def test_decoder_default_line_limit_is_one_mebibyte() -> None:
    assert DEFAULT_MAX_LINE_BYTES == 1 << 20
    line = b"data: " + b"x" * (DEFAULT_MAX_LINE_BYTES - 6)
    assert Decoder().feed(line + b"\n\n") == [Event("x" * (DEFAULT_MAX_LINE_BYTES - 6))]


# --- divergence 5: bounded events --------------------------------------------------------


def test_decoder_event_data_at_limit_is_accepted(decode: Decode) -> None:
    # "ab" + LF + "cd" + LF: 6 characters in the data buffer.
    assert decode(b"data: ab\ndata: cd\n\n", max_event_chars=6).events == [Event("ab\ncd")]


def test_decoder_event_data_over_limit_raises_and_refuses_more(decode: Decode) -> None:
    with pytest.raises(EventTooLargeError) as excinfo:
        decode(b"data: a\n\n" + b"data: ab\n" * 3 + b"\n", max_event_chars=8)
    assert excinfo.value.max_event_chars == 8


def test_decoder_event_limit_resets_at_each_dispatch(decode: Decode) -> None:
    stream = b"data: abc\n\n" * 50
    assert decode(stream, max_event_chars=4).events == [Event("abc")] * 50


def test_decoder_many_short_data_lines_cannot_grow_without_end() -> None:
    decoder = Decoder(max_event_chars=1000)
    for _ in range(499):  # 499 lines of "x" + LF: 998 characters buffered
        decoder.feed(b"data: x\n")
    with pytest.raises(EventTooLargeError):
        decoder.feed(b"data: xy\n")
    with pytest.raises(SSEDecodeError, match="earlier error"):
        decoder.feed(b"\n")


@pytest.mark.parametrize("max_event_chars", [0, -1, True, 1.5])
def test_decoder_rejects_bad_max_event_chars(max_event_chars: int) -> None:
    with pytest.raises(ConfigError, match="max_event_chars"):
        Decoder(max_event_chars=max_event_chars)


def test_decoder_long_line_fed_bytewise_keeps_buffer_to_one_line() -> None:
    decoder = Decoder()
    for _ in range(10_000):
        decoder.feed(b"x")
    assert decoder.feed(b"\n\ndata: y\n\n") == [Event("y")]


def test_decoder_fast_path_keeps_the_id_and_the_limits() -> None:
    """Whole ``data:`` events fed one per chunk (the fast path) dispatch what the line
    path does: the last id carries over, and both limits still apply."""
    decoder = Decoder(max_line_bytes=16, max_event_chars=8)
    assert decoder.feed(b"id: 7\ndata: a\n\n") == [Event(data="a", event="message", id="7")]
    assert decoder.feed(b"data: b\n\n") == [Event(data="b", event="message", id="7")]
    assert decoder.feed(b"data: \n\n") == [Event(data="", event="message", id="7")]
    with pytest.raises(EventTooLargeError):
        decoder.feed(b"data: 12345678\n\n")
    decoder = Decoder(max_line_bytes=16, max_event_chars=64)
    decoder.feed(b"data: a\n\n")
    with pytest.raises(LineTooLongError):
        decoder.feed(b"data: " + b"x" * 11 + b"\n\n")
