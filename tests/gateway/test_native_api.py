"""The native JSON API: create, status, cancel, last-reader-leaves, and bad input."""

from __future__ import annotations

import httpx
import orjson
import pytest

from sluice.sse import Decoder, Event
from tests.rawhttp import open_get
from tests.server import ServerProcess, wait_for_state


def create(server: ServerProcess, **body: object) -> dict[str, object]:
    response = httpx.post(f"{server.base_url}/v1/streams", json={"model": "words", **body})
    assert response.status_code == 201, response.text
    created: dict[str, object] = response.json()
    assert response.headers["location"] == f"/v1/streams/{created['id']}"
    return created


def status(server: ServerProcess, stream_id: object) -> dict[str, object]:
    response = httpx.get(f"{server.base_url}/v1/streams/{stream_id}")
    assert response.status_code == 200
    described: dict[str, object] = response.json()
    return described


def test_create_returns_urls_and_status_counts_events(server: ServerProcess) -> None:
    created = create(server, prompt="one two three", interval_ms=0)
    token = created["resume_token"]
    assert created["events_url"] == f"/v1/streams/{created['id']}/events?token={token}"
    assert created["cancel_url"] == f"/v1/streams/{created['id']}/cancel"
    assert created["model"] == "words"
    assert created["resumable"] is True
    response = httpx.get(f"{server.base_url}{created['events_url']}")
    assert response.status_code == 200
    described = status(server, created["id"])
    assert described["state"] == "finished"
    assert described["finish_reason"] == "stop"
    assert described["tokens"] == 3
    assert described["events"] == 6  # start, 3 tokens, usage, done


def test_explicit_cancel_stops_the_producer_and_ends_with_one_done(
    server: ServerProcess,
) -> None:
    created = create(server, prompt="w " * 500, interval_ms=20)
    response = open_get(server.port, str(created["events_url"]))
    decoder = Decoder()
    events: list[Event] = []
    cancelled = False
    for piece in response.body():
        events.extend(decoder.feed(piece))
        if not cancelled and sum(e.event == "token" for e in events) >= 3:
            cancel = httpx.post(f"{server.base_url}{created['cancel_url']}")
            assert cancel.status_code == 202
            cancelled = True
    response.close()
    assert [e.event for e in events].count("done") == 1
    assert events[-1].event == "done"
    assert orjson.loads(events[-1].data) == {"reason": "cancelled"}
    usage = orjson.loads(events[-2].data)
    num_tokens = sum(e.event == "token" for e in events)
    assert usage["completion_tokens"] == num_tokens < 500
    described = status(server, created["id"])
    assert described["state"] == "cancelled"
    assert described["tokens"] == num_tokens  # nothing produced after the terminal event
    again = httpx.post(f"{server.base_url}{created['cancel_url']}")
    assert again.status_code == 202
    assert again.json()["state"] == "cancelled"


def test_last_reader_leaving_a_non_resumable_stream_cancels_it(server: ServerProcess) -> None:
    created = create(server, prompt="w " * 500, interval_ms=20, resumable=False)
    response = open_get(server.port, str(created["events_url"]))
    decoder = Decoder()
    seen = 0
    for piece in response.body():
        seen += sum(e.event == "token" for e in decoder.feed(piece))
        if seen >= 3:
            break
    response.close()
    described = wait_for_state(server, created["id"], "cancelled")
    tokens_then = described["tokens"]
    assert isinstance(tokens_then, int)
    assert tokens_then < 500
    replay = httpx.get(f"{server.base_url}{created['events_url']}")
    events = Decoder().feed(replay.content)
    assert events[-1].event == "done"
    assert orjson.loads(events[-1].data) == {"reason": "cancelled"}
    assert status(server, created["id"])["tokens"] == tokens_then


@pytest.mark.parametrize(
    ("body", "status_code", "fragment"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b"", 400, "empty"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"interval_ms": 5}', 400, "prompt: Field required"),
        (b'{"prompt": 5}', 400, "prompt: Input should be a valid string"),
        (b'{"prompt": "x", "resumable": "yes"}', 400, "resumable"),
        (b'{"prompt": "x", "interval_ms": -1}', 400, "interval_ms"),
        (b'{"prompt": "x", "interval_ms": 1e9}', 400, "interval_ms: must be between 0"),
        (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"prompt": "x", "grace_s": -1}', 400, "grace_s"),
        (b'{"prompt": "x", "colour": "red"}', 400, "colour: Extra inputs are not permitted"),
        (b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
        (b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
        (b'{"prompt": "x", "seed": -5}', 400, "seed"),
        (b'{"prompt": "x", "stop": [""]}', 400, "stop.0"),
        (orjson.dumps({"prompt": "x", "stop": ["s"] * 17}), 400, "stop"),
        (b'{"prompt": "x", "model": "gpt-9"}', 404, "unknown model 'gpt-9'"),
        (orjson.dumps({"prompt": "x" * 300_000}), 400, "over the limit of 200000"),
        (b'{"prompt": "' + b"x" * 2_000_000 + b'"}', 413, "request body over"),
    ],
)
def test_bad_create_requests_get_a_4xx_that_says_what_was_wrong(
    server: ServerProcess, body: bytes, status_code: int, fragment: str
) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/streams", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status_code
    error = response.json()["error"]
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error"


UNKNOWN = "str_" + "A" * 22


@pytest.mark.parametrize(
    ("method", "target", "headers", "status_code", "code"),
    [
        ("GET", f"/v1/streams/{UNKNOWN}", {}, 404, "stream_not_found"),
        ("GET", f"/v1/streams/{UNKNOWN}/events", {}, 404, "stream_not_found"),
        ("POST", f"/v1/streams/{UNKNOWN}/cancel", {}, 404, "stream_not_found"),
        ("GET", "/v1/streams/not-an-id/events", {}, 400, "bad_event_id"),
        ("GET", "/v1/streams/not-an-id", {}, 400, "bad_event_id"),
        ("POST", "/v1/streams/x/cancel", {}, 400, "bad_event_id"),
        (
            "GET",
            f"/v1/streams/{UNKNOWN}/events",
            {"Last-Event-ID": "garbage"},
            400,
            "bad_event_id",
        ),
        ("GET", "/v1/demo/words", {}, 400, "invalid_request"),
        ("GET", "/v1/demo/words?text=a&interval_ms=abc", {}, 400, "invalid_request"),
        ("GET", "/v1/demo/words?text=a&interval_ms=-5", {}, 400, "invalid_request"),
        ("GET", "/v1/demo/words?text=a&interval_ms=nan", {}, 400, "invalid_request"),
        ("GET", "/v1/demo/words?text=a&max_tokens=1.5", {}, 400, "invalid_request"),
        ("GET", "/v1/demo/words?text=a", {"Last-Event-ID": "str_x:1"}, 400, "bad_event_id"),
        (
            "GET",
            "/v1/demo/words?text=a",
            {"Last-Event-ID": f"{UNKNOWN}:3"},
            404,
            "stream_not_found",
        ),
        ("GET", "/nowhere", {}, 404, "not_found"),
        ("DELETE", "/v1/streams", {}, 405, "method_not_allowed"),
    ],
)
def test_bad_reads_get_a_clear_json_error(
    server: ServerProcess,
    method: str,
    target: str,
    headers: dict[str, str],
    status_code: int,
    code: str,
) -> None:
    response = httpx.request(method, server.base_url + target, headers=headers)
    assert response.status_code == status_code
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == code


def test_last_event_id_must_name_the_stream_in_the_path_and_not_run_ahead(
    server: ServerProcess,
) -> None:
    first = create(server, prompt="a b", interval_ms=0)
    second = create(server, prompt="a b", interval_ms=0)
    response = httpx.get(
        f"{server.base_url}{first['events_url']}", headers={"Last-Event-ID": f"{second['id']}:1"}
    )
    assert response.status_code == 400
    assert "belongs to stream" in response.json()["error"]["message"]
    ahead = httpx.get(f"{server.base_url}{first['events_url']}&last_event_id={first['id']}:99")
    assert ahead.status_code == 400


@pytest.mark.parametrize("method", ["TRACE", "DELETE", "PUT"])
def test_unsupported_methods_are_405_naming_the_methods_the_path_serves(
    server: ServerProcess, method: str
) -> None:
    created = create(server, prompt="a b", interval_ms=0)
    allowed = {
        "/healthz": "GET, HEAD",
        "/v1/models": "GET, HEAD",
        "/v1/models/words": "GET, HEAD",
        "/v1/streams": "POST",
        f"/v1/streams/{created['id']}": "GET, HEAD",
        f"/v1/streams/{created['id']}/cancel": "POST",
        f"/v1/streams/{created['id']}/events": "GET",  # the SSE paths, fast or not
        "/v1/demo/words": "GET",
        "/v1/chat/completions": "POST",
    }
    for path, methods in allowed.items():
        response = httpx.request(method, f"{server.base_url}{path}")
        assert response.status_code == 405, path
        assert response.headers["allow"] == methods, path
        assert response.json()["error"]["code"] == "method_not_allowed"
    anthropic = httpx.request(method, f"{server.base_url}/v1/messages")
    assert anthropic.status_code == 405
    assert anthropic.headers["allow"] == "POST"
    assert anthropic.json()["type"] == "error"


def test_unknown_paths_under_an_api_answer_in_its_error_shape(server: ServerProcess) -> None:
    for path in ("/v1/messages/count_tokens", "/v1/messages/batches/x"):
        response = httpx.post(f"{server.base_url}{path}", json={})
        assert response.status_code == 404
        assert response.json() == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "Not Found"},
        }
    native = httpx.get(f"{server.base_url}/v1/nowhere")
    assert native.status_code == 404
    assert native.json()["error"]["code"] == "not_found"


def test_models_health_and_page(server: ServerProcess) -> None:
    models = httpx.get(f"{server.base_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["sluice-tiny", "words"]
    assert httpx.get(f"{server.base_url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/readyz").status_code == 200
    page = httpx.get(f"{server.base_url}/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
