"""The Durable Streams wire rules, sans-IO: offsets, header values, JSON messages, SSE
frames and cursors (:mod:`sluice.transports.durable`)."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.errors import InvalidParameterError
from sluice.sse import Decoder
from sluice.transports.durable import (
    CURSOR_EPOCH_S,
    CURSOR_INTERVAL_S,
    NOW,
    control_frame,
    cursor_after,
    data_frame,
    format_offset,
    json_messages,
    parse_expires_at,
    parse_offset,
    parse_producer,
    parse_ttl,
    read_body,
)


@given(st.integers(0, 10**16 - 1), st.integers(0, 10**16 - 1))
def test_offsets_sort_as_the_positions_they_name(a: int, b: int) -> None:
    assert (format_offset(a) < format_offset(b)) == (a < b)
    assert parse_offset(format_offset(a)) == a


def test_sentinels_name_the_start_and_the_tail() -> None:
    assert parse_offset("-1") == 0 == parse_offset(format_offset(0))
    assert parse_offset("now") == NOW
    assert format_offset(42) == "0000000000000042_0000000000000000"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0,1",
        "0 1",
        "abc",
        "42",
        "-2",
        "../x",
        "0000000000000001_0000000000000001",
        "000000000000001_0000000000000000",
        "0000000000000001_0000000000000000\n",
    ],
)
def test_malformed_offsets_are_refused(text: str) -> None:
    with pytest.raises(InvalidParameterError):
        parse_offset(text)


@pytest.mark.parametrize("text", ["+60", "060", "60.5", "1e3", "-1", "", "abc"])
def test_ttl_is_digits_only(text: str) -> None:
    with pytest.raises(InvalidParameterError):
        parse_ttl(text)


def test_ttl_and_expiry_values() -> None:
    assert parse_ttl("0") == 0
    assert parse_ttl("3600") == 3600
    assert parse_expires_at("2030-01-01T00:00:00Z") == parse_expires_at("2030-01-01T00:00:00+00:00")
    with pytest.raises(InvalidParameterError):
        parse_expires_at("not-a-timestamp")


def test_producer_headers_come_all_three_or_none() -> None:
    assert parse_producer(None, None, None) is None
    producer = parse_producer("p", "1", "0")
    assert producer is not None
    assert (producer.id, producer.epoch, producer.seq) == ("p", 1, 0)
    for partial in (("p", None, None), (None, "0", "0"), ("p", "0", None), ("", "0", "0")):
        with pytest.raises(InvalidParameterError):
            parse_producer(*partial)
    for bad in ("1abc", "0xyz", "1e3", "-1", str(2**53)):
        with pytest.raises(InvalidParameterError):
            parse_producer("p", bad, "0")


def test_a_json_append_flattens_one_level() -> None:
    assert json_messages(b'{"a": 1}') == [b'{"a":1}']
    assert json_messages(b'[1, [2, 3], {"b": [4]}]') == [b"1", b"[2,3]", b'{"b":[4]}']
    assert json_messages(b"[[[1]]]") == [b"[[1]]"]
    assert json_messages(b"[]") == []
    assert json_messages(b'"\\ud800"') == [b'"\\ud800"']  # a lone surrogate stays escaped
    for bad in (b"{ invalid json }", b"NaN", b"[1,", b"\xff"):
        with pytest.raises(ValueError):  # noqa: PT011 - json's and UTF-8's errors alike
            json_messages(bad)


def test_a_json_read_is_one_array_of_every_message() -> None:
    assert read_body([b"1,2", b'{"a":3}'], json_mode=True) == b'[1,2,{"a":3}]'
    assert read_body([], json_mode=True) == b"[]"
    assert read_body([b"ab", b"c"], json_mode=False) == b"abc"


def events_of(frames: bytes) -> list[tuple[str, str]]:
    return [(event.event, event.data) for event in Decoder().feed(frames)]


@pytest.mark.parametrize(
    "payload", ["a\r\nb", "a\rb", "a\nb", "a\r\n\r\nevent: control\r\ndata: {}"]
)
def test_text_data_cannot_forge_an_event(payload: str) -> None:
    frames = data_frame(payload.encode(), "text/plain") + control_frame(
        format_offset(1), cursor="7", up_to_date=True, closed=False
    )
    events = events_of(frames)
    assert [name for name, _ in events] == ["data", "control"]
    assert events[0][1].split("\n") == payload.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    assert b"data:a" in frames  # no space after the colon (the suite reads it so)


def test_binary_data_is_base64() -> None:
    ((name, data),) = events_of(data_frame(b"\x00\n\r\xff", "application/octet-stream"))
    assert name == "data"
    assert base64.b64decode(data) == b"\x00\n\r\xff"


def test_control_events_carry_the_cursor_only_while_open() -> None:
    ((_, open_data),) = events_of(
        control_frame(format_offset(3), cursor="9", up_to_date=False, closed=False)
    )
    assert json.loads(open_data) == {"streamNextOffset": format_offset(3), "streamCursor": "9"}
    ((_, closed_data),) = events_of(
        control_frame(format_offset(3), cursor="9", up_to_date=False, closed=True)
    )
    assert json.loads(closed_data) == {
        "streamNextOffset": format_offset(3),
        "streamClosed": True,
        "upToDate": True,
    }


def test_cursors_never_go_backwards() -> None:
    now = CURSOR_EPOCH_S + 1000 * CURSOR_INTERVAL_S + 5
    assert cursor_after(None, now) == "1000"
    assert cursor_after("999", now) == "1000"  # behind: the current interval
    for echoed in ("1000", "1500"):
        assert int(cursor_after(echoed, now)) > int(echoed)
    assert cursor_after("x", now) == "1000"
