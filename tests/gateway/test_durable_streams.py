"""``/v1/ds/`` against a real server: LLM streams read as durable streams (JSON mode, one
message per native event, offsets that name event ids), with the official Python client
(``durable-streams``) across a cut; long-poll held as ``/poll`` holds it; LLM streams
read-only; and durable streams private to their tenant."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from durable_streams import stream

from sluice.transports.durable import format_offset
from tests.server import ServerProcess, wait_for_state

TEXT = " ".join(f"word{i}" for i in range(12))


def create(server: ServerProcess, **fields: object) -> str:
    body = {"model": "words", "prompt": TEXT, "interval_ms": 0, **fields}
    response = httpx.post(f"{server.base_url}/v1/streams", json=body, timeout=10)
    assert response.status_code == 201, response.text
    stream_id: str = response.json()["id"]
    return stream_id


def seq_of(message: dict[str, Any]) -> int:
    return int(str(message["id"]).rsplit(":", 1)[1])


def text_of(messages: list[dict[str, Any]]) -> str:
    return "".join(m["data"]["text"] for m in messages if m["event"] == "token")


def test_python_client_reads_an_engine_generation_across_a_cut_exactly_once() -> None:
    """The client follows a generation of the embedded engine over SSE; the server drops
    the connection after the first tokens (``/drop``, as a deploy or a proxy would); the
    client resumes from the offset it had, on long-poll, to the end. Every event comes once,
    in order, and the text is the generation's (read again whole, catch-up)."""
    with ServerProcess() as server:
        server.wait_ready()
        body = {"prompt": "The", "max_tokens": 96, "ignore_eos": True, "temperature": 0}
        created = httpx.post(f"{server.base_url}/v1/streams", json=body, timeout=30)
        assert created.status_code == 201, created.text
        stream_id = created.json()["id"]
        url = f"{server.base_url}/v1/ds/streams/{stream_id}"
        before: list[dict[str, Any]] = []
        with stream(url, offset="-1", live="sse") as res:
            for event in res.iter_events(mode="json"):
                cut = not any(m["event"] == "token" for m in before)
                before.extend(event.data)
                if cut and any(m["event"] == "token" for m in before):
                    dropped = httpx.post(f"{server.base_url}/v1/streams/{stream_id}/drop")
                    assert dropped.status_code == 200, dropped.text
            offset = res.offset
        assert before[-1]["event"] != "done", "the cut came after the end"
        assert offset == format_offset(seq_of(before[-1]))
        after: list[dict[str, Any]] = []
        with stream(url, offset=offset, live="long-poll") as res:
            # This client (0.1.0) predates Stream-Closed: it tails until told to stop, so
            # it stops at the stream's terminal event, which is in-band.
            for message in res.iter_json():
                after.append(message)
                if message["event"] in ("done", "error"):
                    break
        assert any(m["event"] == "token" for m in after)
        messages = before + after
        assert [seq_of(m) for m in messages] == list(range(1, len(messages) + 1))
        assert messages[0]["event"] == "start"
        assert messages[-1] == {
            "id": f"{stream_id}:{len(messages)}",
            "event": "done",
            "data": {"reason": "length"},
        }
        with stream(url, offset="-1", live=False) as res:
            whole: list[dict[str, Any]] = res.read_json()
        assert whole == messages
        usage = [m["data"] for m in messages if m["event"] == "usage"]
        assert [u["completion_tokens"] for u in usage] == [96]
        assert text_of(messages) == text_of(whole) != ""


def test_llm_stream_reads_as_json_messages_whose_offsets_name_event_ids() -> None:
    with ServerProcess("--no-model") as server:
        server.wait_ready()
        stream_id = create(server)
        wait_for_state(server, stream_id, "finished")
        url = f"{server.base_url}/v1/ds/streams/{stream_id}"
        head = httpx.head(url)
        assert head.status_code == 200
        assert head.headers["content-type"] == "application/json"
        assert head.headers["stream-closed"] == "true"
        tail = head.headers["stream-next-offset"]
        whole = httpx.get(url, params={"offset": "-1"})
        messages = whole.json()
        assert whole.headers["stream-next-offset"] == tail == format_offset(len(messages))
        assert whole.headers["stream-closed"] == "true"
        assert [m["event"] for m in messages[:2]] == ["start", "token"]
        assert text_of(messages) == TEXT
        # An event id of the stream is an offset too: after event 3, as format_offset(3).
        by_id = httpx.get(url, params={"offset": f"{stream_id}:3"})
        by_offset = httpx.get(url, params={"offset": format_offset(3)})
        assert by_id.json() == by_offset.json() == messages[3:]
        # At the end: EOF at once, on every read mode.
        eof = httpx.get(url, params={"offset": tail, "live": "long-poll"})
        assert eof.status_code == 204
        assert eof.headers["stream-closed"] == "true"
        other = httpx.get(url, params={"offset": f"{stream_id[:-1]}x:3"})
        assert other.status_code == 400


def test_llm_stream_is_read_only() -> None:
    with ServerProcess("--no-model") as server:
        server.wait_ready()
        stream_id = create(server)
        url = f"{server.base_url}/v1/ds/streams/{stream_id}"
        for method in ("PUT", "POST", "DELETE"):
            response = httpx.request(
                method, url, content=b"x", headers={"content-type": "text/plain"}
            )
            assert response.status_code == 405, (method, response.text)
            assert response.headers["allow"] == "GET, HEAD"
        unknown = httpx.get(f"{server.base_url}/v1/ds/streams/str_{'0' * 22}")
        assert unknown.status_code == 404


def test_long_poll_holds_a_reader_and_answers_with_the_next_events() -> None:
    """A ``live=long-poll`` at the tail of a live LLM stream is held as ``/poll`` is: it
    counts as the stream's reader while held, and answers with the events that arrive."""
    with ServerProcess("--no-model") as server:
        server.wait_ready()
        stream_id = create(server, interval_ms=300, grace_s=30)
        url = f"{server.base_url}/v1/ds/streams/{stream_id}"
        start = httpx.get(url, params={"offset": "-1"})
        offset = start.headers["stream-next-offset"]
        held = httpx.get(url, params={"offset": offset, "live": "long-poll"}, timeout=30)
        assert held.status_code == 200, held.text
        events = held.json()
        assert events
        assert seq_of(events[0]) == int(offset.split("_")[0]) + 1
        assert held.headers["stream-cursor"].isdigit()
        described = httpx.get(f"{server.base_url}/v1/streams/{stream_id}").json()
        assert described["readers"] == 0  # the poll's reader left with its answer


@pytest.fixture
def two_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_API_KEYS", "alice:key-a,bob:key-b")


@pytest.mark.usefixtures("two_tenants")
def test_durable_streams_belong_to_their_tenant() -> None:
    alice = {"authorization": "Bearer key-a", "content-type": "text/plain"}
    bob = {"authorization": "Bearer key-b", "content-type": "text/plain"}
    with ServerProcess("--no-model") as server:
        server.wait_ready()
        url = f"{server.base_url}/v1/ds/notes/today"
        assert httpx.put(url, headers=alice, content=b"alice's").status_code == 201
        assert httpx.get(url, headers=bob).status_code == 404
        assert httpx.post(url, headers=bob, content=b"x").status_code == 404
        assert httpx.delete(url, headers=bob).status_code == 404
        assert httpx.put(url, headers=bob, content=b"bob's").status_code == 201
        assert httpx.get(url, headers=alice).text == "alice's"
        assert httpx.get(url, headers=bob).text == "bob's"
        assert httpx.get(url).status_code == 401
        # Another tenant's LLM stream is unknown here too.
        created = httpx.post(
            f"{server.base_url}/v1/streams",
            headers={"authorization": "Bearer key-a"},
            json={"model": "words", "prompt": TEXT},
        )
        assert created.status_code == 201, created.text
        stream_id = created.json()["id"]
        llm = f"{server.base_url}/v1/ds/streams/{stream_id}"
        assert httpx.get(llm, headers=bob, params={"offset": "-1"}).status_code == 404
        assert httpx.get(llm, headers=alice, params={"offset": "-1"}).status_code == 200


def wait_for_readers(server: ServerProcess, stream_id: str, count: int) -> None:
    """Poll ``GET /v1/streams/{id}`` until the stream has ``count`` readers (10 s at most)."""
    deadline = time.monotonic() + 10
    described: dict[str, Any] = {}
    while time.monotonic() < deadline:
        described = httpx.get(f"{server.base_url}/v1/streams/{stream_id}").json()
        if described["readers"] == count:
            return
        time.sleep(0.02)  # polling an observable condition with a deadline
    raise AssertionError(f"the stream never had {count} readers: {described}")


def test_a_client_leaving_mid_read_releases_its_reader() -> None:
    """An SSE read and a held long-poll are the stream's readers; a client that goes away
    mid-read leaves none behind, and the (resumable) generation goes on."""
    with ServerProcess("--no-model") as server:
        server.wait_ready()
        long_text = " ".join(f"w{i}" for i in range(300))  # a minute at 200 ms a word
        stream_id = create(server, prompt=long_text, interval_ms=200, grace_s=30)
        url = f"{server.base_url}/v1/ds/streams/{stream_id}"
        with httpx.stream("GET", url, params={"offset": "-1", "live": "sse"}) as sse:
            assert sse.status_code == 200
            assert sse.headers["content-type"] == "text/event-stream"
            chunks = sse.iter_raw()  # held: dropping the iterator would close the response
            assert b"event: data" in next(chunks)
            wait_for_readers(server, stream_id, 1)
        wait_for_readers(server, stream_id, 0)
        # A word a minute: a long-poll at the tail is held (past its client's patience).
        slow_id = create(server, prompt=long_text, interval_ms=60_000, grace_s=30)
        slow = f"{server.base_url}/v1/ds/streams/{slow_id}"
        params = {"offset": "now", "live": "long-poll"}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while the poll is held
            httpx.get(slow, params=params, timeout=1)
        wait_for_readers(server, slow_id, 0)
        for held in (stream_id, slow_id):
            described = httpx.get(f"{server.base_url}/v1/streams/{held}").json()
            assert described["state"] == "running"
