"""Resume with Last-Event-ID: cut connections anywhere, reconnect, lose and double nothing."""

from __future__ import annotations

import random
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import orjson
import pytest

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


def test_resume_from_a_dropped_position_gets_an_in_band_resume_gap() -> None:
    with ServerProcess("--no-model", "--max-log-events", "20", "--retry", "200") as small:
        text = " ".join(f"w{i}" for i in range(100))
        # Paced so the live reader keeps up with a 20-event log; the retained tail is what
        # a late reconnect can still get.
        events, _, _ = read_events(
            small, "/v1/demo/words?text=" + quote(text) + "&interval_ms=1", None, None
        )
        assert events[-1].event == "done"
        stream_id = events[-1].id.split(":")[0]
        gap, ended, status = read_events(
            small, f"/v1/streams/{stream_id}/events", f"{stream_id}:3", None
        )
        assert status == 200
        assert ended
        assert [e.event for e in gap] == ["error"]
        error = orjson.loads(gap[0].data)
        assert error["code"] == "resume_gap"
        assert "cannot resume after event 3" in error["message"]
        # A position still retained replays normally.
        tail, _, _ = read_events(small, f"/v1/streams/{stream_id}/events", events[-5].id, None)
        assert tail == events[-4:]
