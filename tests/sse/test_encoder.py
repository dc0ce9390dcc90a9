"""Encoder behaviour: every frame asserted byte for byte (WHATWG HTML §9.2.5-§9.2.6)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.errors import SSEEncodeError
from sluice.sse import EventEncoder, encode_comment, encode_event, encode_retry

# --- encode_event ------------------------------------------------------------------------


def test_encode_event_data_only() -> None:
    assert encode_event("hello") == b"data: hello\n\n"


def test_encode_event_with_id_and_event_writes_id_first() -> None:
    assert encode_event("hi", event="token", id="7") == b"id: 7\nevent: token\ndata: hi\n\n"


def test_encode_event_with_event_only() -> None:
    assert encode_event("hi", event="done") == b"event: done\ndata: hi\n\n"


def test_encode_event_with_id_only() -> None:
    assert encode_event("hi", id="s1:42") == b"id: s1:42\ndata: hi\n\n"


def test_encode_event_empty_data_is_one_empty_data_line() -> None:
    assert encode_event("") == b"data: \n\n"


def test_encode_event_empty_id_resets_last_event_id() -> None:
    assert encode_event("x", id="") == b"id: \ndata: x\n\n"


def test_encode_event_empty_event_is_written() -> None:
    assert encode_event("x", event="") == b"event: \ndata: x\n\n"


def test_encode_event_keeps_leading_and_trailing_spaces() -> None:
    assert encode_event("  x ", event=" t", id=" 1") == b"id:  1\nevent:  t\ndata:   x \n\n"


@pytest.mark.parametrize("line_end", ["\n", "\r", "\r\n"], ids=["lf", "cr", "crlf"])
def test_encode_event_splits_data_on_each_line_end(line_end: str) -> None:
    assert encode_event(f"a{line_end}b") == b"data: a\ndata: b\n\n"


def test_encode_event_splits_mixed_line_ends() -> None:
    assert encode_event("a\r\nb\rc\nd") == b"data: a\ndata: b\ndata: c\ndata: d\n\n"


def test_encode_event_keeps_empty_lines_in_data() -> None:
    assert encode_event("a\n") == b"data: a\ndata: \n\n"
    assert encode_event("\n") == b"data: \ndata: \n\n"
    assert encode_event("\r\n\r") == b"data: \ndata: \ndata: \n\n"
    assert encode_event("\n\r\n") == b"data: \ndata: \ndata: \n\n"


def test_encode_event_multiline_data_with_fields() -> None:
    assert encode_event("a\nb", event="t", id="1") == b"id: 1\nevent: t\ndata: a\ndata: b\n\n"


def test_encode_event_does_not_split_on_other_unicode_line_breaks() -> None:
    text = "a\x0bb\x0cc\x1cd\x85e\u2028f\u2029g"
    assert encode_event(text) == b"data: " + text.encode() + b"\n\n"


def test_encode_event_encodes_unicode_as_utf8() -> None:
    frame = encode_event("h\u00e9 \U0001f642", event="t\u00e9", id="\u4e16")
    assert frame == "id: \u4e16\nevent: t\u00e9\ndata: h\u00e9 \U0001f642\n\n".encode()


def test_encode_event_allows_nul_in_data_and_event() -> None:
    assert encode_event("a\0b", event="\0") == b"event: \x00\ndata: a\x00b\n\n"


def test_encode_event_returns_bytes() -> None:
    assert type(encode_event("x")) is bytes


@pytest.mark.parametrize("bad_id", ["a\rb", "a\nb", "a\r\nb", "a\0b", "\n"])
def test_encode_event_rejects_id_with_cr_lf_or_nul(bad_id: str) -> None:
    with pytest.raises(SSEEncodeError, match="id may not contain CR, LF or NUL"):
        encode_event("x", id=bad_id)


@pytest.mark.parametrize("bad_event", ["a\rb", "a\nb", "a\r\nb", "\r"])
def test_encode_event_rejects_event_with_cr_or_lf(bad_event: str) -> None:
    with pytest.raises(SSEEncodeError, match="event type may not contain CR or LF"):
        encode_event("x", event=bad_event)


def test_encode_event_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="id may not contain"):
        encode_event("x", id="\n")


@pytest.mark.parametrize(
    ("data", "event", "id"),
    [("\ud800", None, None), ("a\nb\udfff", None, None), ("x", "\ud800", None), ("x", None, "\udc00")],
)  # fmt: skip
def test_encode_event_rejects_lone_surrogates(data: str, event: str | None, id: str | None) -> None:
    with pytest.raises(SSEEncodeError, match="not encodable as UTF-8") as excinfo:
        encode_event(data, event=event, id=id)
    assert isinstance(excinfo.value.__cause__, UnicodeEncodeError)


# --- encode_comment ----------------------------------------------------------------------


def test_encode_comment_empty_is_bare_colon_line() -> None:
    assert encode_comment() == b":\n"
    assert encode_comment("") == b":\n"


def test_encode_comment_is_one_line_with_no_blank_line_after_it() -> None:
    assert encode_comment("ping") == b": ping\n"
    assert encode_comment("keep-alive") == b": keep-alive\n"


@pytest.mark.parametrize("line_end", ["\n", "\r", "\r\n"], ids=["lf", "cr", "crlf"])
def test_encode_comment_splits_lines(line_end: str) -> None:
    assert encode_comment(f"a{line_end}b") == b": a\n: b\n"


def test_encode_comment_empty_lines_are_bare_colons() -> None:
    assert encode_comment("a\n\nb\n") == b": a\n:\n: b\n:\n"


def test_encode_comment_encodes_unicode_as_utf8() -> None:
    assert encode_comment("\u00e9\U0001f642") == ": \u00e9\U0001f642\n".encode()


@given(text=st.text(alphabet=st.characters(exclude_categories=["Cs"])))
def test_encode_comment_never_writes_a_blank_line(text: str) -> None:
    """Choice 6: every line it writes starts with a colon, so none is blank."""
    lines = encode_comment(text).decode().split("\n")
    assert lines[-1] == ""
    assert all(line.startswith(":") for line in lines[:-1])


def test_encode_comment_rejects_lone_surrogate() -> None:
    with pytest.raises(SSEEncodeError, match="comment is not encodable"):
        encode_comment("\ud800")


# --- encode_retry ------------------------------------------------------------------------


@pytest.mark.parametrize(("retry_ms", "frame"), [(0, b"retry: 0\n\n"), (3000, b"retry: 3000\n\n")])
def test_encode_retry(retry_ms: int, frame: bytes) -> None:
    assert encode_retry(retry_ms) == frame


def test_encode_retry_rejects_negative() -> None:
    with pytest.raises(SSEEncodeError, match="must not be negative"):
        encode_retry(-1)


@pytest.mark.parametrize("bad", [True, False, 1.5, "10", None])
def test_encode_retry_rejects_non_int(bad: object) -> None:
    with pytest.raises(SSEEncodeError, match="must be an int"):
        encode_retry(bad)  # type: ignore[arg-type]


# --- EventEncoder: encode_event for one event type, checked once --------------------------


@given(data=st.text(), id=st.text().filter(lambda s: not any(c in s for c in "\r\n\0")))
def test_event_encoder_equals_encode_event(data: str, id: str) -> None:
    try:
        expected = encode_event(data, event="token", id=id)
    except SSEEncodeError:
        with pytest.raises(SSEEncodeError):
            EventEncoder("token")(data, id)
        return
    assert EventEncoder("token")(data, id) == expected


@pytest.mark.parametrize("bad_id", ["a\nb", "a\rb", "a\0b"])
def test_event_encoder_refuses_bad_ids(bad_id: str) -> None:
    with pytest.raises(SSEEncodeError, match="id"):
        EventEncoder("token")("data", bad_id)


def test_event_encoder_refuses_a_bad_type_once() -> None:
    with pytest.raises(SSEEncodeError, match="event type"):
        EventEncoder("to\nken")
