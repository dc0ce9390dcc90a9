"""The SSE responses on the wire, read from a raw socket against a real server."""

from __future__ import annotations

import itertools
import time
from urllib.parse import quote

import httpx
import orjson

from sluice.sse import Decoder, Event
from tests.rawhttp import open_get
from tests.server import ServerProcess


def create(server: ServerProcess, prompt: str, **fields: object) -> str:
    response = httpx.post(
        f"{server.base_url}/v1/streams", json={"model": "words", "prompt": prompt, **fields}
    )
    assert response.status_code == 201, response.text
    stream_id: str = response.json()["id"]
    return stream_id


def test_demo_stream_bytes_are_exact(server: ServerProcess) -> None:
    response = open_get(
        server.port, "/v1/demo/words?text=" + quote("hi  there\n") + "&interval_ms=0"
    )
    body = b"".join(response.body())
    response.close()
    assert response.status == 200
    stream_id = body.split(b"id: ", 1)[1].split(b":", 1)[0].decode()
    created = orjson.loads(body.split(b"data: ", 1)[1].split(b"\n", 1)[0])["created"]
    assert body == (
        b"retry: 200\n\n"
        + f"id: {stream_id}:1\nevent: start\n".encode()
        + b'data: {"model":"words","created":%d}\n\n' % created
        + f'id: {stream_id}:2\nevent: token\ndata: {{"text":"hi"}}\n\n'.encode()
        + f'id: {stream_id}:3\nevent: token\ndata: {{"text":"  there\\n"}}\n\n'.encode()
        + f"id: {stream_id}:4\nevent: usage\n".encode()
        + b'data: {"prompt_tokens":2,"completion_tokens":2,"cached_tokens":0}\n\n'
        + f'id: {stream_id}:5\nevent: done\ndata: {{"reason":"stop"}}\n\n'.encode()
    )


def test_sse_headers_are_exact_and_hop_by_hop_free(server: ServerProcess) -> None:
    response = open_get(server.port, "/v1/demo/words?text=a&interval_ms=0", {"Origin": "http://x"})
    b"".join(response.body())
    response.close()
    assert response.header("content-type") == "text/event-stream; charset=utf-8"
    assert response.header("cache-control") == "no-cache"
    assert response.header("x-accel-buffering") == "no"
    assert response.header("access-control-allow-origin") is None  # anonymous: same-origin
    assert response.header("connection") is None
    assert response.header("content-encoding") is None
    assert response.header("content-length") is None


def test_headers_and_retry_arrive_before_any_event_then_idle_heartbeats(
    server: ServerProcess,
) -> None:
    stream_id = create(server, "a b c", interval_ms=60_000)
    # Resume after "a": the next word is a minute away, so nothing is ready to send.
    target = f"/v1/streams/{stream_id}/events?last_event_id={stream_id}:2"
    started = time.monotonic()
    response = open_get(server.port, target)
    head_s = time.monotonic() - started
    pieces = response.body()
    assert next(pieces) == b"retry: 200\n\n"
    assert response.status == 200
    assert head_s < 1.0
    ping_times = []
    for piece in pieces:
        assert piece == b": ping\n"  # a bare comment line: no blank line, no empty event
        ping_times.append(time.monotonic())
        if len(ping_times) == 3:
            break
    response.close()
    gaps = [b - a for a, b in itertools.pairwise(ping_times)]
    assert all(0.2 < gap < 2.0 for gap in gaps), gaps  # the server runs --heartbeat-interval 0.3
    httpx.post(f"{server.base_url}/v1/streams/{stream_id}/cancel")


def test_tokens_arrive_one_by_one_as_they_are_produced(server: ServerProcess) -> None:
    words = [f"w{i}" for i in range(10)]
    response = open_get(
        server.port, "/v1/demo/words?text=" + quote(" ".join(words)) + "&interval_ms=100"
    )
    decoder = Decoder()
    arrivals: list[tuple[float, Event]] = []
    for piece in response.body():
        now = time.monotonic()
        arrivals.extend((now, event) for event in decoder.feed(piece) if event.event == "token")
    response.close()
    assert [orjson.loads(e.data)["text"].strip() for _, e in arrivals] == words
    times = [t for t, _ in arrivals]
    assert times[-1] - times[0] > 0.7
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert sum(gap > 0.05 for gap in gaps) >= 8  # each token in its own write, not one lump
