"""Resume with Last-Event-ID: cut connections anywhere, reconnect, lose and double nothing."""

from __future__ import annotations

import random
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.sse import Decoder, Event
from tests.rawhttp import open_get
from tests.server import ServerProcess


def read_events(
    server: ServerProcess, target: str, last_id: str | None, cut_after_bytes: int | None
) -> tuple[list[Event], bool, int]:
    """Events from one connection, cut after ``cut_after_bytes`` of body if given.

    Returns the complete events received, whether the body ended by itself, and the status.
    """
    headers = {"Last-Event-ID": last_id} if last_id else {}
    response = open_get(server.port, target, headers)
    if response.status != 200:
        response.close()
        return [], True, response.status
    decoder = Decoder()
    events: list[Event] = []
    received = 0
    ended = True
    for piece in response.body():
        if cut_after_bytes is not None and received + len(piece) >= cut_after_bytes:
            events.extend(decoder.feed(piece[: cut_after_bytes - received]))
            ended = False
            break
        received += len(piece)
        events.extend(decoder.feed(piece))
    events.extend(decoder.close())
    response.close()
    return events, ended, 200


def read_with_cuts(server: ServerProcess, target: str, cuts: Iterator[int]) -> list[Event]:
    """Read a stream to its end, dropping the connection at each cut and resuming."""
    events: list[Event] = []
    last_id: str | None = None
    for _ in range(1000):
        got, ended, status = read_events(server, target, last_id, next(cuts, None))
        if status == 204:
            return events
        assert status == 200
        events.extend(got)
        if got:
            last_id = got[-1].id
        if ended:
            return events
    raise AssertionError("the stream never ended")


def tokens(events: list[Event]) -> str:
    return "".join(orjson.loads(e.data)["text"] for e in events if e.event == "token")


@pytest.mark.parametrize("seed", range(6))
def test_resume_after_cuts_at_random_bytes_equals_the_uninterrupted_stream(
    server: ServerProcess, seed: int
) -> None:
    rng = random.Random(seed)
    text = " ".join(f"word{i}" + "é" * rng.randrange(3) for i in range(40))
    response = httpx.post(
        f"{server.base_url}/v1/streams",
        json={"model": "words", "prompt": text, "interval_ms": rng.choice([0, 3])},
    )
    stream_id = response.json()["id"]
    target = f"/v1/streams/{stream_id}/events"
    # Cut points in body bytes, many inside an event (between its bytes), some at 1 byte.
    cuts = iter([rng.randrange(1, 120) for _ in range(25)])
    resumed = read_with_cuts(server, target, cuts)
    whole, ended, _ = read_events(server, target, None, None)
    assert ended
    assert resumed == whole
    assert [e.id for e in resumed] == [f"{stream_id}:{n}" for n in range(1, len(whole) + 1)]
    assert tokens(resumed) == text
    assert [e.event for e in resumed].count("done") == 1


def test_demo_url_resumes_its_own_stream_on_reconnect(server: ServerProcess) -> None:
    text = " ".join(f"t{i}" for i in range(30))
    target = "/v1/demo/words?text=" + quote(text) + "&interval_ms=2"
    resumed = read_with_cuts(server, target, iter([150, 90, 200, 40]))
    assert tokens(resumed) == text
    assert len({e.id.split(":")[0] for e in resumed}) == 1  # one stream, never restarted
    assert [e.event for e in resumed][-1] == "done"


def test_reconnect_after_the_terminal_event_gets_204(server: ServerProcess) -> None:
    events, _, _ = read_events(server, "/v1/demo/words?text=a%20b&interval_ms=0", None, None)
    stream_id = events[-1].id.split(":")[0]
    for target in (f"/v1/streams/{stream_id}/events", "/v1/demo/words?text=a%20b"):
        response = httpx.get(server.base_url + target, headers={"Last-Event-ID": events[-1].id})
        assert response.status_code == 204
        assert response.content == b""


def _counter(server: ServerProcess, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


@pytest.fixture(scope="module")
def small() -> Iterator[ServerProcess]:
    """A server whose logs keep 20 events."""
    with ServerProcess("--no-model", "--max-log-events", "20", "--retry", "200") as server:
        yield server.wait_ready()


def test_reads_from_a_dropped_position_are_410_gone_and_counted_as_resume_gaps(
    small: ServerProcess,
) -> None:
    text = " ".join(f"w{i}" for i in range(100))
    # Paced so the live reader keeps up with a 20-event log; the retained tail is what
    # a late reconnect can still get.
    events, _, _ = read_events(
        small, "/v1/demo/words?text=" + quote(text) + "&interval_ms=1", None, None
    )
    assert events[-1].event == "done"
    stream_id = events[-1].id.split(":")[0]
    gaps = _counter(small, "sluice_resume_gaps_total")
    # A resume after event 3, and a fresh read (the first events are gone too), on the
    # events URL and on the demo URL: refused before the response starts, for good.
    refused = [
        httpx.get(f"{small.base_url}/v1/streams/{stream_id}/events?last_event_id={stream_id}:3"),
        httpx.get(f"{small.base_url}/v1/streams/{stream_id}/events"),
        httpx.get(
            f"{small.base_url}/v1/demo/words?text=x", headers={"Last-Event-ID": f"{stream_id}:3"}
        ),
    ]
    for response in refused:
        assert response.status_code == 410, response.request.url
        error = response.json()["error"]
        assert error["code"] == "resume_gap"
        assert "the oldest retained event is" in error["message"]
    assert "cannot resume after event 3" in refused[0].json()["error"]["message"]
    assert _counter(small, "sluice_resume_gaps_total") == gaps + len(refused)
    # A position still retained replays normally.
    tail, _, _ = read_events(small, f"/v1/streams/{stream_id}/events", events[-5].id, None)
    assert tail == events[-4:]


def test_a_stream_that_outruns_the_log_before_its_creation_is_answered_is_created(
    small: ServerProcess,
) -> None:
    """The create waits for the stream's first event to tell a start from a refusal; when
    the log has already dropped it, the stream started."""
    text = " ".join(f"w{i}" for i in range(100))
    for _ in range(3):
        response = httpx.post(
            f"{small.base_url}/v1/streams", json={"prompt": text, "interval_ms": 0}
        )
        assert response.status_code == 201, response.text


def test_a_reader_behind_the_log_gets_an_in_band_gap_that_names_its_position(
    small: ServerProcess,
) -> None:
    """Unpaced, the first burst (64 words) lands in one append, past the 20-event log: the
    reader's next read finds its position gone after the response started. The event's id
    is that position, so EventSource's reconnect names it and gets the ``410``."""
    text = " ".join(f"w{i}" for i in range(100))
    events, ended, status = read_events(
        small, "/v1/demo/words?text=" + quote(text) + "&interval_ms=0", None, None
    )
    assert (status, ended) == (200, True)
    gap = events[-1]
    assert gap.event == "error"
    assert orjson.loads(gap.data)["code"] == "resume_gap"
    stream_id, _, position = gap.id.partition(":")
    delivered = [event for event in events[:-1] if event.id]
    assert position == (delivered[-1].id.partition(":")[2] if delivered else "0")
    again = httpx.get(
        f"{small.base_url}/v1/demo/words?text=" + quote(text), headers={"Last-Event-ID": gap.id}
    )
    assert again.status_code == 410
    assert stream_id in again.json()["error"]["message"]


@pytest.mark.parametrize("path", ["events", "demo"])
def test_an_empty_last_event_id_header_leaves_the_query_to_name_the_position(
    server: ServerProcess, path: str
) -> None:
    whole, _, _ = read_events(server, "/v1/demo/words?text=a%20b%20c%20d&interval_ms=0", None, None)
    stream_id = whole[-1].id.split(":")[0]
    target = f"/v1/streams/{stream_id}/events" if path == "events" else "/v1/demo/words?text=other"
    separator = "&" if "?" in target else "?"
    response = open_get(
        server.port, f"{target}{separator}last_event_id={whole[2].id}", {"Last-Event-ID": ""}
    )
    assert response.status == 200
    decoder = Decoder()
    resumed = [event for piece in response.body() for event in decoder.feed(piece)]
    response.close()
    assert resumed == whole[3:]
