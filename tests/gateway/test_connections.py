"""Connection-level behaviour: keep-alive, slow readers, shutdown."""

from __future__ import annotations

import socket
import time

import httpx
import orjson

from sluice.sse import Decoder
from tests.rawhttp import open_get
from tests.server import ServerProcess


def test_connection_is_kept_alive_after_an_sse_response(server: ServerProcess) -> None:
    first = open_get(server.port, "/v1/demo/words?text=a%20b&interval_ms=0")
    events = Decoder().feed(b"".join(first.body()))
    assert events[-1].event == "done"
    second = first.next_get("/healthz")
    assert second.status == 200
    assert orjson.loads(second.sized_body()) == {"status": "ok"}
    third = second.next_get(f"/v1/streams/{events[-1].id.split(':')[0]}/events", {})
    events_again = Decoder().feed(b"".join(third.body()))
    assert events_again == events
    third.close()


def test_a_reader_that_stops_reading_gets_everything_when_it_resumes(
    server: ServerProcess,
) -> None:
    """The log absorbs what the client does not read; nothing is lost or reordered (a
    lagging reader's tokens arrive coalesced: fewer events, the same text, rising ids)."""
    words = [f"w{i:06d}" for i in range(20_000)]  # ~1.9 MB of frames: far past the buffers
    created = httpx.post(
        f"{server.base_url}/v1/streams",
        json={"model": "words", "prompt": " ".join(words), "interval_ms": 0},
    ).json()
    response = open_get(server.port, created["events_url"], receive_buffer_bytes=4096)
    # Read nothing while the producer runs to the end: the server's writes back up and it
    # must stop reading the log rather than buffer the stream.
    deadline = time.monotonic() + 20
    while httpx.get(f"{server.base_url}/v1/streams/{created['id']}").json()["state"] != "finished":
        assert time.monotonic() < deadline
        time.sleep(0.02)  # polling an observable condition with a deadline
    decoder = Decoder()
    events = []
    for piece in response.body():
        events.extend(decoder.feed(piece))
    response.close()
    texts = [orjson.loads(e.data)["text"] for e in events if e.event == "token"]
    assert "".join(texts).split() == words
    seqs = [int(e.id.rpartition(":")[2]) for e in events]
    assert all(e.id.startswith(f"{created['id']}:") for e in events)
    assert seqs == sorted(set(seqs))
    assert seqs[0] == 1
    assert seqs[-1] == len(words) + 3  # start, the tokens, usage, done
    assert events[-1].event == "done"


def test_http_1_0_client_gets_an_unchunked_body_ended_by_close() -> None:
    """HTTP/1.0 has no chunked encoding (the native path; uvicorn's ASGI path chunks)."""
    with (
        ServerProcess("--no-model") as server,
        socket.create_connection(("127.0.0.1", server.port)) as sock,
    ):
        sock.settimeout(10)
        sock.sendall(b"GET /v1/demo/words?text=a%20b&interval_ms=0 HTTP/1.0\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    events = Decoder().feed(body)
    assert [e.event for e in events] == ["start", "token", "token", "usage", "done"]
