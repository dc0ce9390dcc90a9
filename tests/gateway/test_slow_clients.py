"""Slow and stuck clients against a real server: the log absorbs the gap, a lagging reader
gets coalesced tokens with exact ids, a stuck one is disconnected after the send timeout
(cancelling a non-resumable stream), and nobody else is slowed down."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from sluice.sse import Decoder, Event
from tests.rawhttp import open_get
from tests.server import ServerProcess

SEND_TIMEOUT_S = 1.0


@pytest.fixture(scope="module", params=["native-sse", "asgi-sse"])
def limited(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    options = ["--no-model", "--heartbeat-interval", "0.3", "--grace", "2"]
    if request.param == "asgi-sse":
        options.append("--no-native-sse")
    options += ["--send-timeout", str(SEND_TIMEOUT_S)]
    with ServerProcess(*options, send_buffer_bytes=32 * 1024) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="module", params=["native-sse", "asgi-sse"])
def small_buffers(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """Default send timeout, and send buffers small enough that a pause shows at once."""
    options = ["--no-model", "--heartbeat-interval", "0.3", "--grace", "2"]
    if request.param == "asgi-sse":
        options.append("--no-native-sse")
    with ServerProcess(*options, send_buffer_bytes=32 * 1024) as server:
        server.wait_ready()
        yield server


def describe(server: ServerProcess, stream_id: str) -> dict[str, object]:
    described: dict[str, object] = httpx.get(f"{server.base_url}/v1/streams/{stream_id}").json()
    return described


def poll(condition: str, check: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never: {condition}"
        time.sleep(0.02)  # polling an observable condition with a deadline


def read_events(
    server: ServerProcess, path: str, headers: dict[str, str] | None = None
) -> list[Event]:
    decoder = Decoder()
    events: list[Event] = []
    with httpx.stream("GET", f"{server.base_url}{path}", headers=headers, timeout=30) as response:
        assert response.status_code == 200
        for piece in response.iter_raw():
            events.extend(decoder.feed(piece))
    return events


def token_text(events: list[Event]) -> str:
    return "".join(orjson.loads(e.data)["text"] for e in events if e.event == "token")


def seq_of(event: Event) -> int:
    return int(event.id.rpartition(":")[2])


def test_stuck_reader_is_disconnected_after_the_send_timeout_without_slowing_others(
    limited: ServerProcess,
) -> None:
    """A client that never reads (tiny receive window) fills its buffers; after the send
    timeout it is dropped, its non-resumable stream is cancelled, a ticking stream read
    meanwhile keeps its pace, and the server's memory stays bounded."""
    rss_before = limited.rss_bytes()
    ticks: list[float] = []
    tick = httpx.post(
        f"{limited.base_url}/v1/streams",
        json={"prompt": " ".join(["tick"] * 150), "interval_ms": 20, "model": "words"},
    ).json()

    def read_ticks() -> None:
        decoder = Decoder()
        url = f"{limited.base_url}{tick['events_url']}"
        with httpx.stream("GET", url, timeout=30) as response:
            for piece in response.iter_raw():
                ticks.extend(time.monotonic() for e in decoder.feed(piece) if e.event == "token")

    reader = threading.Thread(target=read_ticks)
    reader.start()
    words = [f"w{i:019d}" for i in range(9_000)]  # ~1 MB of frames, one per millisecond
    stuck = httpx.post(
        f"{limited.base_url}/v1/streams",
        json={"prompt": " ".join(words), "interval_ms": 1, "resumable": False},
    ).json()
    response = open_get(limited.port, stuck["events_url"], receive_buffer_bytes=4096)
    try:
        poll("stuck reader dropped", lambda: describe(limited, stuck["id"])["readers"] == 0)
        poll(
            "stuck stream cancelled", lambda: describe(limited, stuck["id"])["state"] == "cancelled"
        )
        assert describe(limited, stuck["id"])["tokens"] < len(words)
    finally:
        response.close()
    reader.join(timeout=30)
    assert len(ticks) == 150
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert max(gaps) < 1.0, max(gaps)  # 20 ms apart; nothing waited on the stuck client
    assert limited.rss_bytes() - rss_before < 64 * 1024 * 1024
    metrics = httpx.get(f"{limited.base_url}/metrics").text
    assert 'sluice_sse_disconnects_total{reason="send_timeout"}' in metrics


def test_lagging_reader_gets_coalesced_tokens_whose_ids_resume_exactly(
    small_buffers: ServerProcess,
) -> None:
    """A reader that reads nothing until the stream ends is behind by thousands of tokens:
    it gets them in fewer, larger events, and a resume from any of their ids is exact."""
    server = small_buffers
    words = [f"w{i:06d}" for i in range(20_000)]
    created = httpx.post(
        f"{server.base_url}/v1/streams",
        json={"model": "words", "prompt": " ".join(words), "interval_ms": 0},
    ).json()
    response = open_get(server.port, created["events_url"], receive_buffer_bytes=4096)
    poll("finished", lambda: describe(server, created["id"])["state"] == "finished")
    decoder = Decoder()
    events: list[Event] = []
    for piece in response.body():
        events.extend(decoder.feed(piece))
    response.close()
    tokens = [e for e in events if e.event == "token"]
    assert token_text(events).split() == words
    assert len(tokens) < len(words)  # fewer, larger events
    merged = [e for e in tokens if len(orjson.loads(e.data)["text"].split()) > 1]
    assert merged
    # Resuming from a merged event's id gives exactly what follows it.
    middle = merged[len(merged) // 2]
    after = read_events(server, created["events_url"], {"Last-Event-ID": middle.id})
    assert seq_of(after[0]) == seq_of(middle) + 1
    before = token_text(events[: events.index(middle) + 1])
    assert before + token_text(after) == token_text(events)
    assert after[-1].event == "done"


@pytest.mark.timeout(180)
def test_a_reader_stuck_for_a_minute_costs_the_other_streams_nothing() -> None:
    """The issue's case at full length: a client stops reading for 60 s (the send timeout
    is longer, so it is not dropped) while its stream keeps producing 500 tokens a
    second. A stream read meanwhile keeps its 20 ms pace, and the server's memory stays
    bounded: the log keeps at most --max-log-events per stream, nothing is queued per
    connection."""
    options = ["--no-model", "--send-timeout", "120", "--max-log-events", "5000"]
    with ServerProcess(*options, send_buffer_bytes=32 * 1024) as server:
        server.wait_ready()
        rss_before = server.rss_bytes()
        # 35,000 tokens at 2 ms (70 s, ~1.8 MB of frames), inside the prompt bound
        stuck = httpx.post(
            f"{server.base_url}/v1/streams",
            json={"prompt": "w " * 35_000, "interval_ms": 2, "model": "words"},
        ).json()
        response = open_get(server.port, stuck["events_url"], receive_buffer_bytes=4096)
        num_ticks = 3000  # 60 s at 20 ms
        tick = httpx.post(
            f"{server.base_url}/v1/streams",
            json={"prompt": "tick " * num_ticks, "interval_ms": 20, "model": "words"},
        ).json()
        ticks: list[float] = []
        decoder = Decoder()
        try:
            url = f"{server.base_url}{tick['events_url']}"
            with httpx.stream("GET", url, timeout=30) as ticking:
                for piece in ticking.iter_raw():
                    ticks += [time.monotonic() for e in decoder.feed(piece) if e.event == "token"]
            held = describe(server, stuck["id"])
            assert held["readers"] == 1  # still attached, never drained
            assert held["state"] == "running"
            rss_growth = server.rss_bytes() - rss_before
        finally:
            response.close()
    assert len(ticks) == num_ticks
    gaps = sorted(b - a for a, b in itertools.pairwise(ticks))
    assert gaps[len(gaps) // 2] < 0.05  # the 20 ms pace, not the stuck client's
    assert gaps[-1] < 1.0
    assert rss_growth < 64 * 1024 * 1024
