"""Long-poll (``GET /v1/streams/{id}/poll``) against a real server: batches after a cursor,
holds, timeouts, the end, gaps, bad parameters, the grace window, and resume from SSE."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from sluice.sse import Decoder, Event
from tests.rawhttp import open_get
from tests.server import ServerProcess, wait_for_state

TEXT = " ".join(f"word{i}" for i in range(30))


def create(server: ServerProcess, **fields: object) -> dict[str, object]:
    body = {"model": "words", "prompt": TEXT, "interval_ms": 0, **fields}
    response = httpx.post(f"{server.base_url}/v1/streams", json=body, timeout=10)
    assert response.status_code == 201, response.text
    created: dict[str, object] = response.json()
    return created


def poll(server: ServerProcess, stream_id: object, **params: object) -> httpx.Response:
    query = {key: str(value) for key, value in params.items()}
    url = f"{server.base_url}/v1/streams/{stream_id}/poll"
    return httpx.get(url, params=query, timeout=90)


def poll_to_the_end(
    server: ServerProcess, stream_id: object, after: str
) -> list[dict[str, object]]:
    """Every event after ``after``, poll after poll, until ``done``; then the 204."""
    events: list[dict[str, object]] = []
    for _ in range(1000):
        answer = poll(server, stream_id, after=after, timeout_s=10)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        events.extend(body["events"])
        after = body["next"]
        if body["done"]:
            assert poll(server, stream_id, after=after).status_code == 204
            return events
    raise AssertionError("the stream never ended")


def seqs(events: list[dict[str, object]]) -> list[int]:
    return [int(str(event["id"]).rsplit(":", 1)[1]) for event in events]


def text_of(events: list[dict[str, object]]) -> str:
    parts = []
    for event in events:
        if event["event"] == "token":
            data = event["data"]
            assert isinstance(data, dict)
            parts.append(data["text"])
    return "".join(parts)


def test_a_poll_answers_at_once_with_every_retained_event_after_the_cursor(
    server: ServerProcess,
) -> None:
    created = create(server)
    wait_for_state(server, created["id"], "finished")
    began = time.monotonic()
    answer = poll(server, created["id"], timeout_s=30)
    assert time.monotonic() - began < 10  # answered at once, not held
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("application/json")
    body = answer.json()
    events = body["events"]
    assert events[0]["event"] == "start"
    assert [e["event"] for e in events][-2:] == ["usage", "done"]
    assert seqs(events) == list(range(1, len(events) + 1))
    assert text_of(events) == TEXT
    assert body["done"] is True
    assert body["next"] == f"{created['id']}:{len(events)}"
    # From the middle: exactly the events after the cursor.
    middle = poll(server, created["id"], after=f"{created['id']}:5").json()
    assert middle["events"] == events[5:]


def test_a_poll_past_the_terminal_event_is_204(server: ServerProcess) -> None:
    created = create(server)
    described = wait_for_state(server, created["id"], "finished")
    answer = poll(server, created["id"], after=f"{created['id']}:{described['events']}")
    assert answer.status_code == 204
    assert answer.content == b""


def test_a_poll_with_nothing_new_holds_then_answers_no_events(server: ServerProcess) -> None:
    created = create(server, interval_ms=20_000)  # the second token is 20 s away
    first = poll(server, created["id"], timeout_s=5).json()
    assert first["events"]  # start (and the first token)
    began = time.monotonic()
    answer = poll(server, created["id"], after=first["next"], timeout_s=0.5)
    held_s = time.monotonic() - began
    assert answer.status_code == 200
    assert answer.json() == {"events": [], "next": first["next"], "done": False}
    assert held_s >= 0.5
    httpx.post(f"{server.base_url}/v1/streams/{created['id']}/cancel")


def test_a_held_poll_answers_when_the_next_event_arrives(server: ServerProcess) -> None:
    created = create(server, interval_ms=20_000)
    first = poll(server, created["id"], timeout_s=5).json()
    stream_url = f"{server.base_url}/v1/streams/{created['id']}"
    with ThreadPoolExecutor(1) as pool:
        began = time.monotonic()
        held = pool.submit(poll, server, created["id"], after=first["next"], timeout_s=50)
        wait_until(lambda: httpx.get(stream_url).json()["readers"] == 1)  # the poll is held
        # The cancel's terminal event is what arrives: the held poll answers with it.
        assert httpx.post(f"{stream_url}/cancel").status_code == 202
        body = held.result(timeout=60).json()
    assert time.monotonic() - began < 40
    assert [e["event"] for e in body["events"]][-1] == "done"
    assert body["events"][-1]["data"] == {"reason": "cancelled"}
    assert body["done"] is True


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)  # polling an observable condition with a deadline


def test_resume_from_sse_to_long_poll_with_the_same_cursor_loses_and_doubles_nothing(
    server: ServerProcess,
) -> None:
    created = create(server, interval_ms=20)
    whole = create(server)  # the same greedy words, read whole, to compare with
    wait_for_state(server, whole["id"], "finished")
    expected = poll_to_the_end(server, whole["id"], f"{whole['id']}:0")
    response = open_get(server.port, str(created["events_url"]), {})
    assert response.status == 200
    decoder = Decoder()
    sse: list[Event] = []
    for piece in response.body():
        sse.extend(decoder.feed(piece))
        if sum(1 for e in sse if e.event == "token") >= 7:
            break
    response.close()  # cut mid-stream, and keep only what came before the 7th token's end
    token_indexes = [i for i, e in enumerate(sse) if e.event == "token"]
    sse = sse[: token_indexes[6] + 1]
    last_id = sse[-1].id
    assert last_id is not None
    rest = poll_to_the_end(server, created["id"], last_id)
    sse_seqs = [int(str(e.id).rsplit(":", 1)[1]) for e in sse]
    assert sse_seqs + seqs(rest) == list(range(1, len(sse) + len(rest) + 1))
    sse_text = "".join(orjson.loads(e.data)["text"] for e in sse if e.event == "token")
    assert sse_text + text_of(rest) == text_of(expected) == TEXT


def test_bad_poll_parameters_are_400_naming_the_parameter(server: ServerProcess) -> None:
    created = create(server)
    stream_id = str(created["id"])
    other = str(create(server)["id"])
    for params, named in [
        ({"timeout_s": "61"}, "timeout_s"),
        ({"timeout_s": "-1"}, "timeout_s"),
        ({"timeout_s": "soon"}, "timeout_s"),
        ({"timeout_s": "nan"}, "timeout_s"),
        ({"after": "nonsense"}, "after"),
        ({"after": f"{other}:1"}, "after"),
        ({"after": f"{stream_id}:1.1"}, "after"),
        ({"after": f"{stream_id}:100000"}, "after"),
    ]:
        answer = poll(server, stream_id, **params)
        assert answer.status_code == 400, (params, answer.text)
        assert answer.json()["error"]["message"].startswith(f"{named}:"), answer.text


def test_a_poll_of_an_unknown_stream_is_404(server: ServerProcess) -> None:
    answer = poll(server, "str_" + "0" * 22)
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "stream_not_found"


def test_a_held_poll_counts_as_the_streams_reader_for_the_grace_window(
    server: ServerProcess,
) -> None:
    created = create(server, interval_ms=30_000, grace_s=1)
    first = poll(server, created["id"], timeout_s=5).json()
    # Held for three grace windows: the stream has a reader all along.
    answer = poll(server, created["id"], after=first["next"], timeout_s=3)
    assert answer.json()["events"] == []
    assert httpx.get(f"{server.base_url}/v1/streams/{created['id']}").json()["state"] == "running"
    # Nobody polls now: the grace window runs out and the stream is cancelled.
    described = wait_for_state(server, created["id"], "cancelled")
    assert described["readers"] == 0


@pytest.fixture(scope="module")
def small() -> Iterator[ServerProcess]:
    """A server whose logs keep 20 events."""
    with ServerProcess("--no-model", "--max-log-events", "20") as proc:
        yield proc.wait_ready()


def test_a_poll_from_a_position_the_log_dropped_is_410_resume_gap(small: ServerProcess) -> None:
    created = create(small)
    wait_for_state(small, created["id"], "finished")
    answer = poll(small, created["id"], after=f"{created['id']}:1")
    assert answer.status_code == 410
    assert answer.json()["error"]["code"] == "resume_gap"


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerProcess]:
    proc = ServerProcess("--no-model")
    with pytest.MonkeyPatch.context() as patch:  # the keys reach this server only
        patch.setenv("SLUICE_API_KEYS", "a:key-of-tenant-a-0123456789")
        proc.start()
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def test_a_poll_needs_the_streams_key_or_its_resume_token(keyed: ServerProcess) -> None:
    headers = {"Authorization": "Bearer key-of-tenant-a-0123456789"}
    response = httpx.post(
        f"{keyed.base_url}/v1/streams",
        json={"model": "words", "prompt": TEXT, "interval_ms": 0},
        headers=headers,
    )
    created = response.json()
    url = f"{keyed.base_url}/v1/streams/{created['id']}/poll"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url, headers=headers).status_code == 200
    by_token = httpx.get(url, params={"token": created["resume_token"]})
    assert by_token.status_code == 200
    assert by_token.json()["events"][0]["event"] == "start"
