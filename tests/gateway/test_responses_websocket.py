"""The Responses API's WebSocket mode (``GET /v1/responses`` upgraded) against a real
``sluice serve``: the official ``openai`` SDK's ``client.responses.connect()``, sync and
async, unchanged; its events exactly the SSE stream's payloads; several responses on one
socket; ``response.cancel`` and a closed socket ending a response and freeing the engine's
KV blocks; refused messages answered with ``error`` events on a socket that stays open;
the handshake's ``Origin`` and key checks; a stuck socket closed as on ``/v1/ws``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import orjson
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from sluice.sse import Decoder
from tests.server import ServerProcess, wait_for_state
from tests.transports.wsclient import StuckSocket

MODEL = "sluice-tiny"
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
GREEDY: dict[str, Any] = {
    "model": MODEL,
    "instructions": "Answer briefly.",
    "input": "What does socket.connect do?",
    "max_output_tokens": 12,
    "temperature": 0,
}
RECEIVE_TIMEOUT_S = 30.0
KEY = "key-of-tenant-a-0123456789"
# The SDK's sync client opens its socket with websockets' ``connect()`` outside a ``with``,
# which websockets 17.1 deprecated: the SDK's warning, not the server's.
sync_sdk = pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The bundled tiny engine beside ``words`` (one delivery path: sockets are ASGI's)."""
    with ServerProcess("--heartbeat-interval", "0.3", "--grace", "2") as proc:
        yield proc.wait_ready()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


@contextmanager
def open_socket(server: ServerProcess, **options: Any) -> Iterator[ClientConnection]:
    """A plain ``websockets`` client on ``/v1/responses`` (no proxy, no compression)."""
    uri = f"ws://127.0.0.1:{server.port}/v1/responses"
    with connect(uri, proxy=None, compression=None, open_timeout=30, **options) as ws:
        yield ws


def receive(ws: ClientConnection) -> dict[str, Any]:
    message: dict[str, Any] = orjson.loads(ws.recv(timeout=RECEIVE_TIMEOUT_S))
    return message


def until_terminal(next_event: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    events = [next_event()]
    while events[-1]["type"] not in TERMINAL:
        events.append(next_event())
    return events


def sse_payloads(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of each event of ``POST /v1/responses`` streamed over SSE."""
    decoder = Decoder()
    payloads: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", f"{server.base_url}/v1/responses", json={**body, "stream": True}, timeout=60
    ) as answer:
        assert answer.status_code == 200
        for chunk in answer.iter_bytes():
            payloads += [orjson.loads(event.data) for event in decoder.feed(chunk)]
    return payloads


_RUN_FIELDS = frozenset({"created_at", "cached_tokens"})


def normalised(payload: object, response_id: str) -> object:
    """``payload`` with what differs between two runs of one request (the response id and
    the ids derived from it, the creation time, how much of the prompt the engine's prefix
    cache held) made equal."""
    text = orjson.dumps(payload).decode().replace(response_id.removeprefix("resp_"), "ID")
    value = orjson.loads(text)

    def strip(node: object) -> object:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in _RUN_FIELDS}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return strip(value)


# A response the engine runs for a while: 200 tokens (the tiny model holds 256).
LONG: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 200, "ignore_eos": True}


def until_deltas(next_event: Callable[[], dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Events up to the ``count``-th text delta (a refusal or an early end fails)."""
    events: list[dict[str, Any]] = []
    while sum(e["type"] == "response.output_text.delta" for e in events) < count:
        events.append(next_event())
        assert events[-1]["type"] not in (*TERMINAL, "error"), events[-1]
    return events


def engine_stats(server: ServerProcess) -> dict[str, int]:
    stats: dict[str, int] = httpx.get(f"{server.base_url}/readyz").json()["engines"][MODEL]
    return stats


def wait_until(what: str, condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)  # polling an observable condition with a deadline


def stream_id_of(response_id: str) -> str:
    return "str_" + response_id.removeprefix("resp_")


@sync_sdk
def test_sdk_connect_streams_the_same_events_and_text_as_the_http_api(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    with client.responses.connect() as connection:
        connection.response.create(**GREEDY)
        raw = until_terminal(lambda: orjson.loads(connection.recv_bytes()))
        # The SDK's own parsing of the same socket: a second response, read as typed events.
        connection.response.create(**GREEDY)
        typed = [connection.recv()]
        while typed[-1].type not in TERMINAL:
            typed.append(connection.recv())
    assert [e["type"] for e in raw[:2]] == ["response.created", "response.in_progress"]
    assert raw[-1]["type"] == "response.completed" or raw[-1]["type"] == "response.incomplete"
    assert [e["sequence_number"] for e in raw] == list(range(len(raw)))
    text = "".join(e["delta"] for e in raw if e["type"] == "response.output_text.delta")
    assert text.strip()
    assert raw[-1]["response"]["output"][0]["content"][0]["text"] == text

    whole = client.responses.create(**GREEDY)
    assert whole.output_text == text
    assert typed[-1].response.output_text == text  # type: ignore[union-attr]
    assert typed[-1].response.id != raw[-1]["response"]["id"]  # type: ignore[union-attr]

    # Exactly what the Responses dialect renders for SSE, payload for payload.
    over_sse = sse_payloads(server, GREEDY)
    ws_id = raw[0]["response"]["id"]
    sse_id = over_sse[0]["response"]["id"]
    assert [normalised(p, sse_id) for p in over_sse] == [normalised(p, ws_id) for p in raw]


def test_async_sdk_runs_two_responses_side_by_side_on_one_socket_by_lane(
    server: ServerProcess,
) -> None:
    async def run() -> dict[str, list[Any]]:
        sdk = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        async with sdk, sdk.responses.connect() as connection:
            await connection.response.create(**GREEDY, stream_id="a")
            await connection.response.create(**{**GREEDY, "input": "Say hi."}, stream_id="b")
            lanes: dict[str, list[Any]] = {"a": [], "b": []}
            done: set[str] = set()
            while len(done) < 2:
                event = await asyncio.wait_for(connection.recv(), RECEIVE_TIMEOUT_S)
                lane = event.stream_id  # type: ignore[union-attr]
                lanes[lane].append(event)
                if event.type in TERMINAL:
                    done.add(lane)
            return lanes

    lanes = asyncio.run(run())
    first, second = lanes["a"], lanes["b"]
    assert first[0].response.id != second[0].response.id
    for events in (first, second):
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert {e.response.id for e in events if hasattr(e, "response")} == {events[0].response.id}
    text = "".join(e.delta for e in first if e.type == "response.output_text.delta")
    assert text == first[-1].response.output_text
    assert text.strip()


@sync_sdk
def test_response_cancel_ends_the_response_and_frees_the_engines_kv_blocks(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    with client.responses.connect() as connection:
        connection.send({"type": "response.create", **LONG})  # type: ignore[misc]
        events = until_deltas(lambda: orjson.loads(connection.recv_bytes()), 3)
        busy = engine_stats(server)
        assert busy["running"] == 1, busy
        assert busy["kv_blocks_used"] > 0, busy
        response_id = events[0]["response"]["id"]
        connection.send({"type": "response.cancel", "response_id": response_id})  # type: ignore[misc, typeddict-item]
        rest = until_terminal(lambda: orjson.loads(connection.recv_bytes()))
        # The socket stays open: a cancel of the ended response is refused, a new one runs.
        connection.send({"type": "response.cancel", "response_id": response_id})  # type: ignore[misc, typeddict-item]
        refused = orjson.loads(connection.recv_bytes())
        connection.response.create(**GREEDY)
        after = until_terminal(lambda: orjson.loads(connection.recv_bytes()))
    assert [e["type"] for e in rest[-2:]] == ["error", "response.failed"]
    assert rest[-2]["code"] == "cancelled"
    assert rest[-1]["response"]["status"] == "cancelled"
    assert refused["type"] == "error"
    assert refused["status"] == 404
    assert refused["error"]["code"] == "response_not_found"
    assert after[-1]["type"] in ("response.completed", "response.incomplete")
    wait_until(
        "the engine freed the request",
        lambda: engine_stats(server)["running"] == engine_stats(server)["kv_blocks_used"] == 0,
    )
    assert wait_for_state(server, stream_id_of(response_id), "cancelled")


def test_closing_the_socket_cancels_its_response_and_frees_its_blocks(
    server: ServerProcess,
) -> None:
    with open_socket(server) as ws:
        ws.send(orjson.dumps({"type": "response.create", **LONG}).decode())
        events = until_deltas(lambda: receive(ws), 2)
        assert engine_stats(server)["kv_blocks_used"] > 0
    wait_for_state(server, stream_id_of(events[0]["response"]["id"]), "cancelled")
    wait_until("blocks freed", lambda: engine_stats(server)["kv_blocks_used"] == 0)


def test_refused_messages_get_an_error_event_and_the_socket_stays_open(
    server: ServerProcess,
) -> None:
    refused: list[tuple[str | bytes, int, str | None]] = [
        ("not json", 400, None),
        ("[1, 2]", 400, None),
        ('{"type": "response.shout"}', 400, None),
        ('{"type": "response.cancel"}', 400, None),
        ('{"type": "response.create", "stream_id": 7, "input": "x"}', 400, None),
        ('{"type": "response.create"}', 400, "input"),
        ('{"type": "response.create", "input": "x", "temperature": 5}', 400, "temperature"),
        ('{"type": "response.create", "input": "x", "previous_response_id": "r"}', 400, None),
        ('{"type": "response.create", "input": "x", "model": "nope"}', 404, None),
        ('{"type": "response.cancel", "response_id": "resp_x"}', 404, None),
        (b"\x00binary", 400, None),
    ]
    with open_socket(server) as ws:
        for message, status, param in refused:
            ws.send(message)
            answer = receive(ws)
            assert answer["type"] == "error", (message, answer)
            assert answer["status"] == status, (message, answer)
            assert answer["error"]["message"], (message, answer)
            assert answer["error"]["type"], (message, answer)
            if param is not None:
                assert answer["error"]["param"] == param, (message, answer)
        lane = {"type": "response.create", "input": "x", "temperature": 5, "stream_id": "l"}
        ws.send(orjson.dumps(lane).decode())
        assert receive(ws)["stream_id"] == "l"  # a lane's refusal names its lane
        ws.send(orjson.dumps({"type": "response.create", **GREEDY}).decode())
        events = until_terminal(lambda: receive(ws))  # still open, still serving
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_origin_is_checked_against_the_cors_settings(server: ServerProcess) -> None:
    with pytest.raises(InvalidStatus) as refused, open_socket(server, origin="http://evil.example"):
        pass
    assert refused.value.response.status_code == 403
    assert orjson.loads(refused.value.response.body)["error"]["code"] == "origin_refused"
    with open_socket(server, origin=f"http://127.0.0.1:{server.port}") as ws:
        ws.send('{"type": "response.cancel", "response_id": "resp_x"}')
        assert receive(ws)["status"] == 404


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerProcess]:
    proc = ServerProcess("--no-model")
    with pytest.MonkeyPatch.context() as patch:  # the keys reach this server only
        patch.setenv("SLUICE_API_KEYS", f"a:{KEY}")
        proc.start()
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


@sync_sdk
def test_a_socket_needs_the_bearer_key_the_http_api_needs(keyed: ServerProcess) -> None:
    with pytest.raises(InvalidStatus) as refused, open_socket(keyed):
        pass
    assert refused.value.response.status_code == 401
    wrong = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key="wrong-key", max_retries=0)
    with wrong, pytest.raises(InvalidStatus) as refused_sdk, wrong.responses.connect():
        pass
    assert refused_sdk.value.response.status_code == 401
    with (
        openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY, max_retries=0) as sdk,
        sdk.responses.connect() as connection,
    ):
        connection.response.create(model="words", input="one two three four")
        events = [connection.recv()]
        while events[-1].type not in TERMINAL:
            events.append(connection.recv())
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def limited() -> Iterator[ServerProcess]:
    """A short send timeout and small send buffers: a client that reads nothing is stuck."""
    options = ["--no-model", "--send-timeout", "1", "--max-log-events", "5000"]
    with ServerProcess(*options, send_buffer_bytes=32 * 1024) as proc:
        yield proc.wait_ready()


def send_timeouts(server: ServerProcess) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith('sluice_sse_disconnects_total{reason="send_timeout"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_socket_that_reads_nothing_is_closed_1008_after_the_send_timeout(
    limited: ServerProcess,
) -> None:
    before = send_timeouts(limited)
    stuck = StuckSocket(limited, path="/v1/responses")
    try:
        words = " ".join(f"w{i:019d}" for i in range(3000))
        stuck.send_json({"type": "response.create", "model": "words", "input": words})
        wait_until("the send timeout", lambda: send_timeouts(limited) == before + 1)
        messages, code = stuck.drain()
    finally:
        stuck.close()
    assert code in (1008, None)  # a close frame the stuck socket may never have taken
    assert messages[0]["type"] == "response.created"
    assert all(str(m["type"]).startswith("response.") for m in messages)
    assert messages[-1]["type"] not in TERMINAL  # cut: it never read to the end
