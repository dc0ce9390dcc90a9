"""Connections that never finish a request are closed, on both SSE paths, while real
requests keep being served: a silent socket within ``--head-timeout`` of connecting, a head
sent in part within ``--head-timeout`` (answered 408), a body sent in part within
``--body-timeout`` of its head (408); a kept-alive connection after an SSE response within
``--keep-alive-timeout``. Idle and half-sent connections do not count toward
``--max-connections``."""

from __future__ import annotations

import resource
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from sluice.sse import Decoder
from tests.rawhttp import open_get, read_until_closed, wait_closed
from tests.server import ServerProcess

HEAD_S = 2.0
BODY_S = 3.0
# How late a close may be seen past its deadline: the server accepts and reads hundreds
# of sockets on a shared 2-core machine. Not how early: the deadlines start on the
# server's side, after the client connected and sent.
LATE_S = 3.0
EARLY_S = 0.25
NUM_SILENT = 300
NUM_PARTIAL_HEADS = 50
NUM_SLOW_BODIES = 50  # each of: Content-Length with 1 byte sent, and chunked with 1 chunk


@pytest.fixture(autouse=True, scope="module")
def _descriptors_for_hundreds_of_sockets() -> Iterator[None]:
    """This process and the servers it starts (they inherit it) hold ~500 sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if wanted < 1024:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} is under 1024: raise it to run this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _options(native_sse: bool, *extra: str) -> list[str]:
    options = ["--no-model", "--head-timeout", str(HEAD_S), "--body-timeout", str(BODY_S)]
    if not native_sse:
        options.append("--no-native-sse")
    return [*options, *extra]


def _connect(port: int, data: bytes = b"") -> tuple[socket.socket, float]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        sock.sendall(data)
    return sock, time.monotonic()


def _is_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionError:
        return False


def _serves_real_requests(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/healthz", timeout=10).status_code == 200
    created = httpx.post(
        f"{server.base_url}/v1/streams", json={"model": "words", "prompt": "a b c"}, timeout=10
    )
    assert created.status_code == 201
    response = open_get(server.port, created.json()["events_url"])
    assert response.status == 200
    events = Decoder().feed(b"".join(response.body()))
    response.close()
    assert events[-1].event == "done"


@pytest.mark.parametrize("native_sse", [True, False], ids=["native-sse", "asgi-sse"])
def test_silent_and_half_sent_connections_are_closed_within_their_deadlines(
    native_sse: bool,
) -> None:
    partial_head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    sized = (
        b"POST /v1/streams HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    chunked = (
        b"POST /v1/streams HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
    )
    with ServerProcess(*_options(native_sse)) as server:
        server.wait_ready()
        attack = [(_connect(server.port), HEAD_S, b"") for _ in range(NUM_SILENT)]
        attack += [
            (_connect(server.port, partial_head), HEAD_S, b"HTTP/1.1 408 ")
            for _ in range(NUM_PARTIAL_HEADS)
        ]
        for body in (sized, chunked):
            attack += [
                (_connect(server.port, body), BODY_S, b"HTTP/1.1 408 ")
                for _ in range(NUM_SLOW_BODIES)
            ]
        try:
            _serves_real_requests(server)  # while all of them are held
            closes = wait_closed([sock for (sock, _), _, _ in attack], BODY_S + LATE_S + 5)
        finally:
            for (sock, _), _, _ in attack:
                sock.close()
        num_open = sum(closed is None for closed in closes)
        assert num_open == 0, f"{num_open} of {len(attack)} connections never closed"
        for ((_, sent_at), timeout_s, answer), closed in zip(attack, closes, strict=True):
            assert closed is not None
            assert timeout_s - EARLY_S <= closed.at - sent_at <= timeout_s + LATE_S
            assert closed.received.startswith(answer), closed.received[:80]
            if answer:
                assert not closed.reset  # the lingering close lets the 408 arrive
                assert b"connection: close" in closed.received.lower()
                assert b'"code":"request_timeout"' in closed.received
        _serves_real_requests(server)


@pytest.mark.parametrize("native_sse", [True, False], ids=["native-sse", "asgi-sse"])
def test_idle_and_half_sent_connections_do_not_count_toward_max_connections(
    native_sse: bool,
) -> None:
    """60 idle sockets (and 20 unfinished heads) against ``--max-connections 50``."""
    options = ["--no-model", "--max-connections", "50"]
    if not native_sse:
        options.append("--no-native-sse")
    with ServerProcess(*options) as server:
        server.wait_ready()
        held = [_connect(server.port)[0] for _ in range(60)]
        held += [_connect(server.port, b"GET /healthz HTTP/1.1\r\n")[0] for _ in range(20)]
        try:
            _serves_real_requests(server)
            assert all(_is_open(sock) for sock in held)  # the default 10 s deadline: still held
        finally:
            for sock in held:
                sock.close()


@pytest.mark.parametrize("native_sse", [True, False], ids=["native-sse", "asgi-sse"])
def test_a_kept_alive_connection_is_closed_after_its_keep_alive_timeout(native_sse: bool) -> None:
    keep_alive_s = 1.0
    with ServerProcess(*_options(native_sse, "--keep-alive-timeout", str(keep_alive_s))) as server:
        server.wait_ready()
        response = open_get(server.port, "/v1/demo/words?text=a%20b&interval_ms=0")
        events = Decoder().feed(b"".join(response.body()))
        ended_at = time.monotonic()
        assert response.header("connection") is None  # kept alive
        assert events[-1].event == "done"
        closed = read_until_closed(response.sock)
        response.close()
        assert closed.received == b""
        assert keep_alive_s - EARLY_S <= closed.at - ended_at <= keep_alive_s + LATE_S


@pytest.mark.parametrize("native_sse", [True, False], ids=["native-sse", "asgi-sse"])
def test_a_head_begun_on_a_kept_alive_connection_gets_408_at_its_deadline(
    native_sse: bool,
) -> None:
    with ServerProcess(*_options(native_sse, "--keep-alive-timeout", "1")) as server:
        server.wait_ready()
        response = open_get(server.port, "/v1/demo/words?text=a%20b&interval_ms=0")
        assert Decoder().feed(b"".join(response.body()))[-1].event == "done"
        response.sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and no more
        sent_at = time.monotonic()
        closed = read_until_closed(response.sock)
        response.close()
        assert closed.received.startswith(b"HTTP/1.1 408 ")
        assert HEAD_S - EARLY_S <= closed.at - sent_at <= HEAD_S + LATE_S
