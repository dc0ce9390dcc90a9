"""Heartbeats on resumable compatible streams, read by the official SDKs themselves.

A real ``sluice serve --upstream`` with a short ``--heartbeat-interval`` proxies a scripted
upstream that goes quiet after each word until the client has received several ``: ping``
heartbeats (counted in the raw bytes under the SDK). With ``X-Sluice-Resumable: true`` the
frames carry ids, after which the SDKs' SSE decoder would dispatch an empty event for a
heartbeat followed by a blank line; a bare comment line is invisible to it, so the SDK
reads the stream across the heartbeats without error and gets the whole text.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import anthropic
import httpx2
import openai
import pytest

from tests.backends.scripted_upstream import (
    DONE,
    Reply,
    ThreadedUpstream,
    UpstreamRequest,
    chat_chunk,
    sse,
    usage_chunk,
)
from tests.server import ServerProcess

HEARTBEAT_INTERVAL_S = 0.2
PINGS_PER_PAUSE = 3  # heartbeats the client receives while the upstream is quiet
WAIT_S = 10.0  # the bound on every wait; pauses last about a second
WORDS = ["The", " tide", " turns", "."]
RESUMABLE = {"X-Sluice-Resumable": "true"}
PING = b": ping\n"


class PingCounter(httpx2.BaseTransport):
    """An HTTP transport that counts the heartbeats in the response bytes it passes on."""

    def __init__(self) -> None:
        self._inner = httpx2.HTTPTransport()
        self._raw = bytearray()
        self._changed = threading.Condition()
        self.num_pings = 0

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._inner.handle_request(request)
        response.stream = _Counted(response.stream, self)  # type: ignore[arg-type]
        return response

    def saw(self, chunk: bytes) -> None:
        with self._changed:
            self._raw += chunk
            self.num_pings = self._raw.count(PING)
            self._changed.notify_all()

    def wait_for(self, num_pings: int) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self.num_pings >= num_pings, WAIT_S):
                raise AssertionError(f"only {self.num_pings} of {num_pings} heartbeats arrived")

    def close(self) -> None:
        self._inner.close()


class _Counted(httpx2.SyncByteStream):
    def __init__(self, inner: httpx2.SyncByteStream, counter: PingCounter) -> None:
        self._inner = inner
        self._counter = counter

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._counter.saw(chunk)
            yield chunk

    def close(self) -> None:
        self._inner.close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[ThreadedUpstream]:
    with ThreadedUpstream() as server:
        yield server
        assert server.errors == []


@pytest.fixture(scope="module")
def proxy(upstream: ThreadedUpstream) -> Iterator[ServerProcess]:
    options = ["--no-model", "--upstream", upstream.base_url, "--upstream-model", "stub"]
    options += ["--heartbeat-interval", str(HEARTBEAT_INTERVAL_S)]
    with ServerProcess(*options) as process:
        yield process.wait_ready()


def quiet_after_each_word(counter: PingCounter) -> object:
    """A script: each word, then silence until the client has seen more heartbeats."""

    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.head()
        await reply.chunk(sse(chat_chunk("", role="assistant")))
        for number, word in enumerate(WORDS, start=1):
            await reply.chunk(sse(chat_chunk(word)))
            await asyncio.to_thread(counter.wait_for, number * PINGS_PER_PAUSE)
        await reply.chunk(sse(chat_chunk(finish_reason="stop")))
        await reply.chunk(sse(usage_chunk(3, len(WORDS))))
        await reply.chunk(DONE)
        await reply.end()

    return script


def test_the_openai_sdk_reads_a_resumable_stream_across_heartbeats(
    upstream: ThreadedUpstream, proxy: ServerProcess
) -> None:
    counter = PingCounter()
    upstream.script = quiet_after_each_word(counter)  # type: ignore[assignment]
    with openai.OpenAI(
        base_url=f"{proxy.base_url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx2.Client(transport=counter),
    ) as client:
        stream = client.chat.completions.create(
            model="stub",
            messages=[{"role": "user", "content": "Say something."}],
            stream=True,
            extra_headers=RESUMABLE,
        )
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(WORDS)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert counter.num_pings >= len(WORDS) * PINGS_PER_PAUSE


def test_the_anthropic_sdk_reads_a_resumable_stream_across_heartbeats(
    upstream: ThreadedUpstream, proxy: ServerProcess
) -> None:
    counter = PingCounter()
    upstream.script = quiet_after_each_word(counter)  # type: ignore[assignment]
    with (
        anthropic.Anthropic(
            base_url=proxy.base_url,
            api_key="unused",
            max_retries=0,
            http_client=httpx2.Client(transport=counter),
        ) as client,
        client.messages.stream(
            model="stub",
            max_tokens=64,
            messages=[{"role": "user", "content": "Say something."}],
            extra_headers=RESUMABLE,
        ) as stream,
    ):
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(WORDS)
    assert final.stop_reason == "end_turn"
    assert counter.num_pings >= len(WORDS) * PINGS_PER_PAUSE
