"""Requests pipelined on one connection are answered or refused cleanly, never dropped.

Behind an SSE response (native path), the SSE response is delivered whole and the
connection then closed, so the client retries the rest on a new one; on the ASGI path
uvicorn queues the request and answers it after the stream. Behind an ``Upgrade`` the
server does not speak, the first request is answered and the connection closed. A head
far over the limits gets its 431, not a reset (lingering close)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from sluice.sse import Decoder
from tests.rawhttp import read_until_closed, split_responses
from tests.server import ServerProcess

WORDS = "/v1/demo/words?text=a%20b%20c&interval_ms="


@pytest.fixture(scope="module", params=["native-sse", "asgi-sse"])
def words_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    options = ["--no-model"] if request.param == "native-sse" else ["--no-model", "--no-native-sse"]
    with ServerProcess(*options) as server:
        yield server.wait_ready()


def _get(target: str, *headers: str) -> bytes:
    lines = [f"GET {target} HTTP/1.1", "Host: 127.0.0.1", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _assert_whole_stream(head: bytes, body: bytes) -> None:
    assert head.startswith(b"HTTP/1.1 200 ")
    events = Decoder().feed(body)
    assert [e.event for e in events] == ["start", "token", "token", "token", "usage", "done"]


def _assert_answered_or_refused_by_close(
    server: ServerProcess, head: bytes, rest: list[tuple[bytes, bytes]]
) -> None:
    """What follows the first response: on the native path nothing (the first said
    ``connection: close``, then the connection closed); on the ASGI path the answer."""
    if "--no-native-sse" in server.options:
        assert len(rest) == 1
        assert rest[0][0].startswith(b"HTTP/1.1 200 ")
        assert rest[0][1] == b'{"status":"ok"}'
    else:
        assert b"connection: close" in head.lower()
        assert rest == []


@pytest.mark.parametrize("interval_ms", [0, 20])
def test_a_request_pipelined_behind_an_sse_read_in_one_write_is_not_dropped(
    words_server: ServerProcess, interval_ms: int
) -> None:
    with _connect(words_server) as sock:
        sock.sendall(_get(WORDS + str(interval_ms)) + _get("/healthz"))
        closed = read_until_closed(sock)
    assert not closed.reset
    responses, left = split_responses(closed.received)
    assert left == b""
    assert responses, "the SSE response was dropped"
    (head, body), *rest = responses
    _assert_whole_stream(head, body)
    _assert_answered_or_refused_by_close(words_server, head, rest)


def test_a_request_pipelined_while_an_sse_response_streams_is_not_dropped(
    words_server: ServerProcess,
) -> None:
    with _connect(words_server) as sock:
        sock.sendall(_get(WORDS + "200"))
        received = b""
        while b"event: token" not in received:  # the head is out and the stream live
            received += sock.recv(65536)
        sock.sendall(_get("/healthz"))
        closed = read_until_closed(sock)
    assert not closed.reset
    responses, left = split_responses(received + closed.received)
    assert left == b""
    (head, body), *rest = responses
    _assert_whole_stream(head, body)
    if "--no-native-sse" in words_server.options:
        assert [response[1] for response in rest] == [b'{"status":"ok"}']
    else:
        assert rest == []  # its head was out, kept alive: the close says the rest


def test_a_request_pipelined_behind_an_unsupported_upgrade_is_not_left_hanging(
    words_server: ServerProcess,
) -> None:
    # h2c: an upgrade this server does not speak (WebSocket it does, at /v1/ws).
    upgrade = _get("/healthz", "Connection: Upgrade", "Upgrade: h2c")
    with _connect(words_server) as sock:
        sock.sendall(upgrade + _get("/healthz"))
        closed = read_until_closed(sock)  # the connection closes: nothing hangs
    responses, left = split_responses(closed.received)
    assert left == b""
    assert len(responses) == 1
    head, body = responses[0]
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"connection: close" in head.lower()
    assert body == b'{"status":"ok"}'


def test_a_head_far_over_the_limits_gets_its_431_not_a_reset(
    words_server: ServerProcess,
) -> None:
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    with _connect(words_server) as sock:
        # Without a lingering close, the reset may come while it is still sending.
        with contextlib.suppress(ConnectionError):
            sock.sendall(head)
        closed = read_until_closed(sock)
    assert not closed.reset
    assert closed.received.startswith(b"HTTP/1.1 431 ")
    assert b'"code":"headers_too_large"' in closed.received
