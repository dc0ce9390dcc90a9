"""Opt-in resumable compatible streams: every frame carries an id, and resuming from ANY of
them (``GET /v1/streams/{id}/events`` + ``Last-Event-ID``) gives exactly the frames after
it, in the same dialect: no gap, no duplicate, also between two frames of one event."""

from __future__ import annotations

import httpx
import pytest

from sluice.sse import Decoder, Event
from tests.rawhttp import open_get
from tests.server import ServerProcess, wait_for_state

TEXT = "one two  three four"
BODIES = {
    "/v1/chat/completions": {
        "model": "words",
        "messages": [{"role": "user", "content": TEXT}],
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "/v1/messages": {
        "model": "words",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": TEXT}],
        "stream": True,
    },
}


def _read(server: ServerProcess, path: str, last_event_id: str | None) -> list[Event]:
    headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}
    response = open_get(server.port, path, headers)
    if response.status == 204:  # resumed after the last frame: nothing is left
        response.close()
        return []
    try:
        assert response.status == 200, response.status
        return Decoder().feed(b"".join(response.body()))
    finally:
        response.close()


@pytest.mark.parametrize("path", list(BODIES))
def test_resuming_from_every_frame_gives_exactly_the_rest(server: ServerProcess, path: str) -> None:
    response = httpx.post(
        f"{server.base_url}{path}", json=BODIES[path], headers={"X-Sluice-Resumable": "true"}
    )
    assert response.status_code == 200
    stream_id = response.headers["x-sluice-stream-id"]
    frames = Decoder().feed(response.content)
    assert len(frames) >= 8
    assert all(f.id is not None and f.id.startswith(f"{stream_id}:") for f in frames)
    assert len({f.id for f in frames}) == len(frames)
    wait_for_state(server, stream_id, "finished")
    events_path = f"/v1/streams/{stream_id}/events"
    assert _read(server, events_path, None) == frames  # a fresh read replays it all
    for i, frame in enumerate(frames):
        rest = _read(server, events_path, frame.id)
        assert frames[: i + 1] + rest == frames, f"resumed after frame {i} ({frame.id})"


def test_frame_ids_are_refused_on_native_streams(server: ServerProcess) -> None:
    created = httpx.post(
        f"{server.base_url}/v1/streams", json={"model": "words", "prompt": "a b"}
    ).json()
    response = open_get(
        server.port, str(created["events_url"]), {"Last-Event-ID": f"{created['id']}:1.1"}
    )
    assert response.status == 400
    assert b"bad_event_id" in response.sized_body()
    response.close()


def test_without_the_header_frames_have_no_ids(server: ServerProcess) -> None:
    response = httpx.post(f"{server.base_url}/v1/messages", json=BODIES["/v1/messages"])
    frames = Decoder().feed(response.content)
    assert [f.event for f in frames][:2] == ["message_start", "ping"]
    assert frames[-1].event == "message_stop"
    assert all(f.id == "" for f in frames)


@pytest.mark.parametrize("path", list(BODIES))
def test_a_frame_id_past_the_frames_of_its_event_is_refused(
    server: ServerProcess, path: str
) -> None:
    """``<id>:<n>.<k>`` names frame k of event n+1; a k that event never had is a 400 before
    any response, not a 200 that skips the rest of the stream."""
    response = httpx.post(
        f"{server.base_url}{path}", json=BODIES[path], headers={"X-Sluice-Resumable": "true"}
    )
    stream_id = response.headers["x-sluice-stream-id"]
    frames = Decoder().feed(response.content)
    wait_for_state(server, stream_id, "finished")
    events_path = f"/v1/streams/{stream_id}/events"
    last_seq = int(frames[-1].id.rsplit(":", 1)[1])
    # Every event but the last: a frame suffix of 9999 is past the frames of the next one.
    for seq in range(1, last_seq):
        response_ = open_get(server.port, events_path, {"Last-Event-ID": f"{stream_id}:{seq}.9999"})
        assert response_.status == 400, (seq, response_.status)
        assert b"bad_event_id" in response_.sized_body()
        response_.close()
    # The terminal event renders several frames; one past its last frame id is refused,
    # its last frame id itself resumes with the one frame that follows it.
    terminal_frames = [f for f in frames if f.id.startswith(f"{stream_id}:{last_seq - 1}.")]
    assert terminal_frames
    past = f"{stream_id}:{last_seq - 1}.{len(terminal_frames) + 1}"
    refused = open_get(server.port, events_path, {"Last-Event-ID": past})
    assert refused.status == 400
    refused.close()
    assert _read(server, events_path, terminal_frames[-1].id) == frames[-1:]
