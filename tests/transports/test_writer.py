"""The sans-IO HTTP/1.1 response writer: exact bytes, and header values that could split
a response refused instead of written."""

from __future__ import annotations

import pytest

from sluice.transports.http1.writer import (
    LAST_CHUNK,
    InvalidHeaderError,
    chunk,
    response_head,
    status_line,
)


def test_a_head_is_the_status_line_the_fields_and_an_empty_line() -> None:
    head = response_head(200, [(b"content-type", b"text/event-stream")], chunked=True)
    assert head == (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )


def test_a_head_that_ends_the_connection_says_so() -> None:
    assert response_head(204, [], keep_alive=False) == (
        b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n"
    )


def test_a_status_without_a_phrase_gets_an_empty_one_and_a_non_status_is_refused() -> None:
    assert status_line(499) == b"HTTP/1.1 499 \r\n"
    for bad in (99, 600, 1000):
        with pytest.raises(ValueError, match="status"):
            status_line(bad)


@pytest.mark.parametrize(
    "header",
    [
        (b"x-a", b"ok\r\nset-cookie: evil"),
        (b"x-a", b"ok\nx"),
        (b"x-a", b" leading"),
        (b"x-a", b"trailing\t"),
        (b"x a", b"v"),
        (b"x:a", b"v"),
        (b"", b"v"),
    ],
)
def test_a_header_http11_cannot_carry_is_refused(header: tuple[bytes, bytes]) -> None:
    with pytest.raises(InvalidHeaderError):
        response_head(200, [header])


def test_values_with_inner_spaces_and_obs_text_are_written_as_given() -> None:
    head = response_head(200, [(b"x-a", b"a b\tc \xe9")])
    assert b"x-a: a b\tc \xe9\r\n" in head


def test_chunks_are_hex_sized_and_an_empty_one_is_never_written() -> None:
    assert chunk(b"hello world, sixteen") == b"14\r\nhello world, sixteen\r\n"
    assert LAST_CHUNK == b"0\r\n\r\n"
    with pytest.raises(ValueError, match="empty chunk"):
        chunk(b"")
