"""Graceful drain on SIGTERM: ``/readyz`` turns 503 and new streams are refused with 503 +
``Retry-After`` while the listener stays open; streams that can finish within the drain
deadline finish completely; the others end on an event boundary with one retryable
``unavailable`` error; the process exits 0 soon after the deadline. A second SIGTERM is
the deadline, now: every live stream, in every dialect, gets that error at once."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import orjson
import pytest

from sluice.sse import Decoder, Event
from tests.backends.scripted_upstream import (
    Reply,
    ScriptedUpstream,
    UpstreamRequest,
    chat_chunk,
    sse,
)
from tests.rawhttp import RawResponse, open_get, open_post
from tests.server import ServerProcess

DRAIN_S = 10.0  # the case: 50 live streams, a 10 s drain deadline


def _first_token(response: RawResponse) -> tuple[Iterator[bytes], Decoder, list[Event]]:
    decoder = Decoder()
    events: list[Event] = []
    pieces = response.body()
    while not any(e.event == "token" for e in events):
        events += decoder.feed(next(pieces))
    return pieces, decoder, events


def test_sigterm_drains_live_streams_then_exits_zero() -> None:
    with ServerProcess("--no-model", "--drain-timeout", str(DRAIN_S)) as server:
        server.wait_ready()
        short_text = "s " * 20  # 20 x 100 ms: done well within the deadline
        long_text = "l " * 400  # 400 x 50 ms: cut by the deadline
        streams = []
        for text, interval in [(short_text, 100)] * 25 + [(long_text, 50)] * 25:
            target = f"/v1/demo/words?text={quote(text)}&interval_ms={interval}"
            response = open_get(server.port, target)
            streams.append((text, response, *_first_token(response)))
        assert server.process is not None
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        deadline = time.monotonic() + DRAIN_S
        while httpx.get(f"{server.base_url}/readyz").status_code == 200:
            assert time.monotonic() < deadline  # polling an observable condition
            time.sleep(0.01)
        refused = httpx.post(
            f"{server.base_url}/v1/streams", json={"model": "words", "prompt": "late"}
        )
        assert refused.status_code == 503
        assert int(refused.headers["retry-after"]) >= 1
        late_read = open_get(server.port, "/v1/demo/words?text=late&interval_ms=0")
        assert late_read.status == 200  # EventSource would give up on a 503: retry later
        assert late_read.sized_body().startswith(b"retry: ")
        late_read.close()

        for text, response, pieces, decoder, events in streams:
            events += decoder.feed(b"".join(pieces))
            response.close()
            terminal = [e for e in events if e.event in ("done", "error")]
            assert len(terminal) == 1
            assert events[-1] is terminal[0]
            tokens = "".join(orjson.loads(e.data)["text"] for e in events if e.event == "token")
            if text == short_text:
                assert terminal[0].event == "done"
                assert tokens == text
            else:
                assert terminal[0].event == "error"
                error = orjson.loads(terminal[0].data)
                assert error["code"] == "unavailable"
                assert error["retryable"] is True
                assert text.startswith(tokens)
                assert 0 < len(tokens) < len(text)
        assert server.process.wait(timeout=DRAIN_S + 10) == 0
        assert time.monotonic() - started < DRAIN_S + 2


async def _endless_chat(request: UpstreamRequest, reply: Reply) -> None:
    """An upstream that streams a word every 50 ms until its client leaves."""
    await reply.head()
    await reply.chunk(sse(chat_chunk(role="assistant", content="")))
    while not request.connection.closed.is_set():
        await reply.chunk(sse(chat_chunk("word ")))
        await asyncio.sleep(0.05)  # the upstream's pace, not a synchronisation


@pytest.fixture
def endless_upstream() -> Iterator[str]:
    """A scripted OpenAI-compatible upstream on its own thread's loop; its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> ScriptedUpstream:
        upstream = await ScriptedUpstream().start()
        upstream.script = _endless_chat
        return upstream

    upstream = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield upstream.base_url
    finally:
        asyncio.run_coroutine_threadsafe(upstream.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert upstream.errors == []


def _end_with_two_signals(server: ServerProcess, responses: list[RawResponse]) -> list[bytes]:
    """Once each stream has sent a token, SIGTERM, and SIGTERM again once the drain is on;
    each stream's whole body (a clean chunked end, or this raises)."""
    assert [response.status for response in responses] == [200] * len(responses)
    streams = []
    for response in responses:
        pieces = response.body()
        received = b""
        while b"word" not in received and b"event: token" not in received:
            received += next(pieces)
        streams.append((pieces, received))
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.base_url}/readyz").status_code == 200:
        assert time.monotonic() < deadline  # polling an observable condition
        time.sleep(0.01)
    second_at = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    bodies = [received + b"".join(pieces) for pieces, received in streams]
    assert server.process.wait(timeout=20) == 0
    assert time.monotonic() - second_at < 5
    return bodies


@pytest.mark.parametrize("native_sse", [True, False], ids=["native-sse", "asgi-sse"])
def test_a_second_sigterm_ends_every_live_stream_in_its_dialect_at_once(
    endless_upstream: str, native_sse: bool
) -> None:
    """Native, OpenAI and Anthropic streams, live when SIGTERM comes twice: each ends at
    once with its dialect's retryable error and a clean chunked end; the process exits 0
    long before the drain or shutdown timeouts (60 s, 30 s)."""
    options = ["--no-model", "--upstream", endless_upstream, "--upstream-model", "up"]
    options += ["--drain-timeout", "60", "--shutdown-timeout", "30"]
    if not native_sse:
        options.append("--no-native-sse")
    messages = [{"role": "user", "content": "go"}]
    with ServerProcess(*options) as server:
        server.wait_ready()
        native = open_get(server.port, "/v1/demo/words?text=" + "w%20" * 600 + "&interval_ms=100")
        chat = open_post(
            server.port,
            "/v1/chat/completions",
            orjson.dumps({"model": "up", "messages": messages, "stream": True}),
        )
        anthropic = open_post(
            server.port,
            "/v1/messages",
            orjson.dumps({"model": "up", "max_tokens": 4096, "messages": messages, "stream": True}),
        )
        try:
            bodies = _end_with_two_signals(server, [native, chat, anthropic])
        finally:
            for response in (native, chat, anthropic):
                response.close()
    native_events, chat_events, anthropic_events = (Decoder().feed(body) for body in bodies)
    assert native_events[-1].event == "error"
    assert orjson.loads(native_events[-1].data)["code"] == "unavailable"
    assert orjson.loads(native_events[-1].data)["retryable"] is True
    assert [e.event for e in native_events].count("error") == 1

    assert all(e.data != "[DONE]" for e in chat_events)
    chat_error = orjson.loads(chat_events[-1].data)["error"]
    assert chat_error["code"] == "unavailable"
    assert sum("error" in orjson.loads(e.data) for e in chat_events) == 1

    assert anthropic_events[-1].event == "error"
    assert all(e.event != "message_stop" for e in anthropic_events)
    assert orjson.loads(anthropic_events[-1].data)["type"] == "error"
