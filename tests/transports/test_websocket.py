"""``GET /v1/ws`` against a real server with the ``websockets`` client: streams created,
multiplexed, resumed on a new socket after a kill, cancelled (the engine's KV blocks
freed), refused messages answered in-band, the handshake's checks, and stuck clients."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from tests.server import ServerProcess, wait_for_state
from tests.transports.wsclient import StuckSocket, collect, open_ws, receive, send_json

WORDS = " ".join(f"word{i}" for i in range(40))
SEND_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The bundled tiny engine beside ``words``; HTTP deadlines shorter than a socket's life."""
    options = ["--heartbeat-interval", "0.3", "--grace", "2"]
    options += ["--head-timeout", "1", "--body-timeout", "1"]
    with ServerProcess(*options) as proc:
        yield proc.wait_ready()


def create(ws: Any, **request: object) -> dict[str, Any]:
    """Create a stream on ``ws``; its ``created`` answer's stream."""
    send_json(ws, {"type": "create", "request": {"model": "words", "prompt": WORDS, **request}})
    created = receive(ws)
    assert created["type"] == "created", created
    stream: dict[str, Any] = created["stream"]
    return stream


def seqs(events: list[dict[str, Any]]) -> list[int]:
    return [int(str(e["id"]).rsplit(":", 1)[1]) for e in events]


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["data"]["text"] for e in events if e["event"] == "token")


def wait_until(what: str, condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)  # polling an observable condition with a deadline


def engine_stats(server: ServerProcess) -> dict[str, int]:
    stats: dict[str, int] = httpx.get(f"{server.base_url}/readyz").json()["engines"]["sluice-tiny"]
    return stats


def describe(server: ServerProcess, stream_id: str) -> dict[str, Any]:
    described: dict[str, Any] = httpx.get(f"{server.base_url}/v1/streams/{stream_id}").json()
    return described


def test_a_created_stream_arrives_as_native_events_with_the_shared_ids(
    server: ServerProcess,
) -> None:
    with open_ws(server) as ws:
        stream = create(ws, interval_ms=0)
        assert stream["events_url"].startswith(f"/v1/streams/{stream['id']}/events?token=")
        events = collect(ws, stream["id"])
    assert [e["event"] for e in events][:1] == ["start"]
    assert [e["event"] for e in events][-2:] == ["usage", "done"]
    assert seqs(events) == list(range(1, len(events) + 1))
    assert all(e["id"].startswith(f"{stream['id']}:") for e in events)
    assert text_of(events) == WORDS
    # The same ids and data as the long-poll read of the same log.
    polled = httpx.get(f"{server.base_url}/v1/streams/{stream['id']}/poll").json()["events"]
    assert [{k: e[k] for k in ("id", "event", "data")} for e in events] == polled


def test_several_streams_share_one_socket_each_whole_and_in_order(server: ServerProcess) -> None:
    prompts = {f"p{n}": " ".join(f"s{n}w{i}" for i in range(25)) for n in range(3)}
    names = list(prompts)
    ids: dict[str, str] = {}
    by_stream: dict[str, list[dict[str, Any]]] = {}
    with open_ws(server) as ws:
        for prompt in prompts.values():  # all three at once: their events interleave
            request = {"model": "words", "prompt": prompt, "interval_ms": 5}
            send_json(ws, {"type": "create", "request": request})
        num_done = 0
        while num_done < len(prompts):
            message = receive(ws)
            if message["type"] == "created":  # answered in the order they were sent
                ids[message["stream"]["id"]] = names[len(ids)]
                continue
            assert message["type"] == "event", message
            by_stream.setdefault(message["stream_id"], []).append(message)
            num_done += message["event"] == "done"
    assert set(by_stream) == set(ids)
    for stream_id, events in by_stream.items():
        assert seqs(events) == list(range(1, len(events) + 1))
        assert text_of(events) == prompts[ids[stream_id]]


def test_a_socket_killed_mid_stream_resumes_on_a_new_one_without_gap_or_duplicate(
    server: ServerProcess,
) -> None:
    with open_ws(server) as first:
        stream = create(first, interval_ms=20, grace_s=30)
        before = collect(first, stream["id"], count=9)
        # Killed: the connection ends under the client, with no close frame.
        first.socket.shutdown(socket.SHUT_RDWR)
    wait_until("the reader left", lambda: describe(server, stream["id"])["readers"] == 0)
    assert describe(server, stream["id"])["state"] == "running"  # resumable: its grace window
    with open_ws(server) as second:
        send_json(
            second,
            {"type": "subscribe", "stream_id": stream["id"], "last_event_id": before[-1]["id"]},
        )
        after = collect(second, stream["id"])
    assert seqs(before + after) == list(range(1, len(before) + len(after) + 1))
    assert text_of(before) + text_of(after) == WORDS
    assert after[-1]["event"] == "done"


def test_a_subscription_the_server_drops_says_so_and_resumes_on_the_same_socket(
    server: ServerProcess,
) -> None:
    with open_ws(server) as ws:
        stream = create(ws, interval_ms=20, grace_s=30)
        before = collect(ws, stream["id"], count=5)
        dropped = httpx.post(f"{server.base_url}/v1/streams/{stream['id']}/drop").json()
        assert dropped["dropped"] == 1
        while (message := receive(ws))["type"] == "event":
            before.append(message)  # what was on its way before the drop
        assert message["type"] == "error", message
        assert message["code"] == "interrupted", message
        assert message["stream_id"] == stream["id"]
        last = before[-1]["id"]
        send_json(ws, {"type": "subscribe", "stream_id": stream["id"], "last_event_id": last})
        after = collect(ws, stream["id"])
    assert seqs(before + after) == list(range(1, len(before) + len(after) + 1))
    assert text_of(before + after) == WORDS


def test_cancel_on_the_socket_ends_the_stream_and_frees_the_engines_kv_blocks(
    server: ServerProcess,
) -> None:
    with open_ws(server) as ws:
        stream = create(ws, model="sluice-tiny", prompt="hello", max_tokens=200, ignore_eos=True)
        collect(ws, stream["id"], count=4)  # start and three tokens: it runs
        busy = engine_stats(server)
        assert busy["running"] == 1, busy
        assert busy["kv_blocks_used"] > 0, busy
        send_json(ws, {"type": "cancel", "stream_id": stream["id"]})
        rest = collect(ws, stream["id"])
    assert rest[-1]["event"] == "done"
    assert rest[-1]["data"] == {"reason": "cancelled"}
    wait_until(
        "the engine freed the request",
        lambda: engine_stats(server)["running"] == engine_stats(server)["kv_blocks_used"] == 0,
    )
    assert describe(server, stream["id"])["state"] == "cancelled"


def test_closing_the_socket_cancels_its_non_resumable_stream_and_frees_its_blocks(
    server: ServerProcess,
) -> None:
    with open_ws(server) as ws:
        stream = create(
            ws, model="sluice-tiny", prompt="hi", max_tokens=200, ignore_eos=True, resumable=False
        )
        collect(ws, stream["id"], count=3)
        assert engine_stats(server)["kv_blocks_used"] > 0
    wait_for_state(server, stream["id"], "cancelled")
    wait_until("blocks freed", lambda: engine_stats(server)["kv_blocks_used"] == 0)


def test_refused_messages_get_an_error_frame_and_the_socket_stays_open(
    server: ServerProcess,
) -> None:
    unknown = "str_" + "0" * 22
    refused: list[tuple[str | bytes, str]] = [
        ("not json", "invalid_request"),
        ("[1, 2]", "invalid_request"),
        ('{"type": "shout"}', "invalid_request"),
        ('{"type": "subscribe"}', "invalid_request"),
        ('{"type": "subscribe", "stream_id": 7}', "invalid_request"),
        ('{"type": "create", "request": "hello"}', "invalid_request"),
        ('{"type": "create", "request": {"prompt": "x", "temperature": -1}}', "invalid_request"),
        ('{"type": "create", "request": {"prompt": "x", "model": "nope"}}', "model_not_found"),
        ('{"type": "subscribe", "stream_id": "str_bad"}', "bad_event_id"),
        (f'{{"type": "subscribe", "stream_id": "{unknown}"}}', "stream_not_found"),
        (f'{{"type": "cancel", "stream_id": "{unknown}"}}', "stream_not_found"),
        (b"\x00binary", "invalid_request"),
    ]
    with open_ws(server) as ws:
        for message, code in refused:
            ws.send(message)
            answer = receive(ws)
            assert answer["type"] == "error", (message, answer)
            assert answer["code"] == code, (message, answer)
            assert answer["message"]
        stream = create(ws, interval_ms=0)  # still open, still serving
        events = collect(ws, stream["id"])
        assert text_of(events) == WORDS
        # A finished stream replays whole; after its terminal event there is nothing, and
        # the subscription is refused (as the SSE read's 204).
        send_json(ws, {"type": "subscribe", "stream_id": stream["id"], "last_event_id": None})
        assert collect(ws, stream["id"]) == events
        last = events[-1]["id"]
        send_json(ws, {"type": "subscribe", "stream_id": stream["id"], "last_event_id": last})
        ended = receive(ws)
        assert ended["type"] == "error", ended
        assert ended["code"] == "stream_ended", ended
        assert ended["stream_id"] == stream["id"]
        send_json(
            ws,
            {"type": "subscribe", "stream_id": stream["id"], "last_event_id": f"{unknown}:1"},
        )
        assert receive(ws)["code"] == "bad_event_id"


def test_a_message_over_the_size_limit_closes_the_socket(
    server: ServerProcess,
) -> None:
    def send_too_much() -> None:
        with open_ws(server) as ws:
            ws.send("x" * (2 * 1024 * 1024))
            ws.recv(timeout=30)

    with pytest.raises(ConnectionClosed) as closed:
        send_too_much()
    # The server refuses the message from its frame header and closes with 1009 while the
    # client is still sending the rest: the reset of those unread bytes may overtake the
    # close frame (then the client sees the connection lost, with no code).
    received = closed.value.rcvd
    assert received is None or received.code == 1009, received
    with open_ws(server) as ws:  # the server is fine
        stream = create(ws, interval_ms=0)
        assert collect(ws, stream["id"])[-1]["event"] == "done"


def test_an_idle_socket_outlives_the_http_head_and_body_deadlines(server: ServerProcess) -> None:
    with open_ws(server) as ws:
        time.sleep(2.5)  # the subject: time past --head-timeout and --body-timeout (1 s)
        stream = create(ws, interval_ms=0)
        assert collect(ws, stream["id"])[-1]["event"] == "done"


def test_origin_is_checked_against_the_cors_settings(server: ServerProcess) -> None:
    with pytest.raises(InvalidStatus) as refused, open_ws(server, origin="http://evil.example"):
        pass
    assert refused.value.response.status_code == 403
    assert orjson.loads(refused.value.response.body)["error"]["code"] == "origin_refused"
    own = f"http://127.0.0.1:{server.port}"
    with open_ws(server, origin=own) as ws:
        stream = create(ws, interval_ms=0)
        assert collect(ws, stream["id"])[-1]["event"] == "done"
    with pytest.raises(InvalidStatus) as other_port, open_ws(server, origin="http://127.0.0.1:1"):
        pass
    assert other_port.value.response.status_code == 403


def test_another_path_is_refused_with_404(server: ServerProcess) -> None:
    uri = f"ws://127.0.0.1:{server.port}/v1/elsewhere"
    with pytest.raises(InvalidStatus) as refused, connect(uri, proxy=None):
        pass
    assert refused.value.response.status_code == 404


def test_a_malformed_handshake_gets_400_and_the_connection_closes(server: ServerProcess) -> None:
    """``Upgrade: websocket`` without the handshake's key: refused, and what was pipelined
    behind it is not left waiting."""
    head = "GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall((head + "\r\n" + "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").encode())
        received = b""
        while chunk := sock.recv(65536):  # until the server closes
            received += chunk
    assert received.startswith(b"HTTP/1.1 400 ")
    assert received.count(b"HTTP/1.1 ") == 1


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


def test_a_socket_needs_a_key_or_a_streams_resume_token(keyed: ServerProcess) -> None:
    with pytest.raises(InvalidStatus) as refused, open_ws(keyed):
        pass
    assert refused.value.response.status_code == 401
    bearer = {"Authorization": "Bearer key-of-tenant-a-0123456789"}
    with open_ws(keyed, additional_headers=bearer) as ws:
        stream = create(ws, interval_ms=0)
        assert text_of(collect(ws, stream["id"])) == WORDS
        other = create(ws, interval_ms=0)
        collect(ws, other["id"])
    # A browser's way: the resume token in the query reads that stream, and only that.
    with open_ws(keyed, f"?token={stream['resume_token']}") as ws:
        send_json(ws, {"type": "subscribe", "stream_id": stream["id"], "last_event_id": None})
        assert text_of(collect(ws, stream["id"])) == WORDS
        send_json(ws, {"type": "subscribe", "stream_id": other["id"], "last_event_id": None})
        assert receive(ws)["code"] == "stream_not_found"
        send_json(ws, {"type": "create", "request": {"prompt": "x"}})
        assert receive(ws)["code"] == "invalid_api_key"


@pytest.fixture(scope="module")
def limited() -> Iterator[ServerProcess]:
    """A short send timeout, small send buffers, logs of 5,000 events."""
    options = ["--no-model", "--send-timeout", str(SEND_TIMEOUT_S), "--max-log-events", "5000"]
    with ServerProcess(*options, send_buffer_bytes=32 * 1024) as proc:
        yield proc.wait_ready()


def send_timeouts(server: ServerProcess) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith('sluice_sse_disconnects_total{reason="send_timeout"}'):
            return float(line.split()[-1])
    return 0.0


def create_http(server: ServerProcess, **fields: object) -> dict[str, Any]:
    response = httpx.post(f"{server.base_url}/v1/streams", json={"model": "words", **fields})
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def test_a_stuck_socket_is_dropped_after_the_send_timeout_and_its_non_resumable_stream_cancelled(
    limited: ServerProcess,
) -> None:
    timeouts_before = send_timeouts(limited)
    words = [f"w{i:019d}" for i in range(9_000)]
    stream = create_http(limited, prompt=" ".join(words), interval_ms=1, resumable=False)
    stuck = StuckSocket(limited)
    try:
        stuck.send_json({"type": "subscribe", "stream_id": stream["id"], "last_event_id": None})
        wait_for_state(limited, stream["id"], "cancelled")
        assert describe(limited, stream["id"])["tokens"] < len(words)
        assert send_timeouts(limited) == timeouts_before + 1
        messages, code = stuck.drain()
    finally:
        stuck.close()
    assert code in (1008, None)  # a close frame the stuck socket may never have taken
    assert messages
    assert all(m["type"] == "event" for m in messages)


def test_a_stuck_socket_of_a_resumable_stream_resumes_on_a_new_socket_exactly(
    limited: ServerProcess,
) -> None:
    words = [f"w{i:019d}" for i in range(3_000)]
    stream = create_http(limited, prompt=" ".join(words), interval_ms=2, grace_s=60)
    stuck = StuckSocket(limited)
    try:
        stuck.send_json({"type": "subscribe", "stream_id": stream["id"], "last_event_id": None})
        wait_until(
            "the stuck reader dropped", lambda: describe(limited, stream["id"])["readers"] == 0
        )
        assert describe(limited, stream["id"])["state"] == "running"  # its grace window
        before, code = stuck.drain()
    finally:
        stuck.close()
    assert code in (1013, None)
    with open_ws(limited) as ws:
        send_json(
            ws, {"type": "subscribe", "stream_id": stream["id"], "last_event_id": before[-1]["id"]}
        )
        after = collect(ws, stream["id"])
    assert seqs(after)[0] == seqs(before)[-1] + 1
    assert (text_of(before) + text_of(after)).split() == words


def test_a_lagging_socket_gets_coalesced_tokens_whose_ids_resume_exactly() -> None:
    with ServerProcess("--no-model", send_buffer_bytes=32 * 1024) as server:
        server.wait_ready()
        words = [f"w{i:06d}" for i in range(20_000)]
        stream = create_http(server, prompt=" ".join(words), interval_ms=0)
        lagging = StuckSocket(server)
        try:
            lagging.send_json(
                {"type": "subscribe", "stream_id": stream["id"], "last_event_id": None}
            )
            wait_for_state(server, stream["id"], "finished")
            events, _ = lagging.drain(until_terminal=True)
        finally:
            lagging.close()
        tokens = [e for e in events if e["event"] == "token"]
        assert text_of(events).split() == words
        assert len(tokens) < len(words)  # fewer, larger messages
        merged = [e for e in tokens if len(e["data"]["text"].split()) > 1]
        assert merged
        middle = merged[len(merged) // 2]
        with open_ws(server) as ws:
            send_json(
                ws, {"type": "subscribe", "stream_id": stream["id"], "last_event_id": middle["id"]}
            )
            after = collect(ws, stream["id"])
        assert seqs(after)[0] == seqs([middle])[0] + 1
        assert text_of(events[: events.index(middle) + 1]) + text_of(after) == text_of(events)


def test_a_position_the_log_dropped_is_refused_with_resume_gap(limited: ServerProcess) -> None:
    stream = create_http(limited, prompt=" ".join(["w"] * 6_000), interval_ms=0)
    wait_for_state(limited, stream["id"], "finished")
    with open_ws(limited) as ws:
        send_json(
            ws,
            {"type": "subscribe", "stream_id": stream["id"], "last_event_id": f"{stream['id']}:1"},
        )
        refusal = receive(ws)
    assert refusal["type"] == "error"
    assert refusal["code"] == "resume_gap"
    assert refusal["stream_id"] == stream["id"]
