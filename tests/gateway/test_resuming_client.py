"""The official SDKs read a resumable stream across cut connections, unchanged, through
:class:`sluice.client.ResumingTransport` in their ``http_client``.

A real ``sluice serve``; under the resuming transport, a transport that cuts the first
connections mid-frame (as a dying gateway or a proxy would: the body ends with a read
error). The SDK's text is the whole answer, nothing missing or doubled, and without the
resuming transport the same cut breaks the SDK's stream (the cut is real).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import anthropic
import httpx2
import openai
import pytest

from sluice.client import AsyncResumingTransport, ResumeSettings, ResumingTransport
from tests.server import ServerProcess

TEXT = " ".join(f"word{i}é" for i in range(80))
RESUMABLE = {"X-Sluice-Resumable": "true"}
MESSAGES = [{"role": "user", "content": TEXT}]
# Where the first connections are cut: mid-frame, at arbitrary bytes.
CUTS = (700, 333)
FAST = ResumeSettings(initial_delay_s=0.01)


class _CutBody(httpx2.SyncByteStream, httpx2.AsyncByteStream):
    def __init__(self, response: httpx2.Response, cut_at: int) -> None:
        self._response, self._cut_at = response, cut_at

    def __iter__(self) -> Iterator[bytes]:
        sent = 0
        try:
            for chunk in self._response.iter_raw():
                if sent + len(chunk) >= self._cut_at:
                    yield chunk[: self._cut_at - sent]
                    raise httpx2.ReadError("connection cut by the test")
                sent += len(chunk)
                yield chunk
        finally:
            self._response.close()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        sent = 0
        try:
            async for chunk in self._response.aiter_raw():
                if sent + len(chunk) >= self._cut_at:
                    yield chunk[: self._cut_at - sent]
                    raise httpx2.ReadError("connection cut by the test")
                sent += len(chunk)
                yield chunk
        finally:
            await self._response.aclose()


class Cutter(httpx2.BaseTransport, httpx2.AsyncBaseTransport):
    """Cuts the bodies of the first ``len(cuts)`` streamed responses at those bytes."""

    def __init__(self, cuts: tuple[int, ...] = CUTS) -> None:
        self._cuts = list(cuts)
        self._sync = httpx2.HTTPTransport()
        self._async = httpx2.AsyncHTTPTransport()
        self.resumes: list[httpx2.Request] = []

    def _cut(self, request: httpx2.Request, response: httpx2.Response) -> httpx2.Response:
        if request.method == "GET":
            self.resumes.append(request)
        if not self._cuts or response.status_code != 200:
            return response
        body = _CutBody(response, self._cuts.pop(0))
        return httpx2.Response(response.status_code, headers=response.headers, stream=body)

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        return self._cut(request, self._sync.handle_request(request))

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        return self._cut(request, await self._async.handle_async_request(request))

    def close(self) -> None:
        self._sync.close()

    async def aclose(self) -> None:
        await self._async.aclose()


def openai_client(server: ServerProcess, transport: httpx2.BaseTransport) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )


def chat_text(client: openai.OpenAI) -> tuple[str, str | None]:
    stream = client.chat.completions.create(
        model="words", messages=MESSAGES, stream=True, extra_headers=RESUMABLE
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].choices[0].finish_reason


def test_the_openai_sdk_reads_chat_completions_whole_across_two_cuts(
    server: ServerProcess,
) -> None:
    cutter = Cutter()
    with openai_client(server, ResumingTransport(cutter, FAST)) as client:
        text, finish_reason = chat_text(client)
    assert text == TEXT
    assert finish_reason == "stop"
    assert len(cutter.resumes) == 2
    assert all(r.url.path.endswith("/events") for r in cutter.resumes)
    assert all(r.headers["last-event-id"] for r in cutter.resumes)


def test_without_the_resuming_transport_the_same_cut_breaks_the_stream(
    server: ServerProcess,
) -> None:
    with (
        openai_client(server, Cutter()) as client,
        pytest.raises((openai.APIConnectionError, httpx2.ReadError)),
    ):
        chat_text(client)


def test_the_openai_sdk_reads_a_responses_stream_whole_across_two_cuts(
    server: ServerProcess,
) -> None:
    with openai_client(server, ResumingTransport(Cutter(), FAST)) as client:
        stream = client.responses.create(
            model="words", input=TEXT, stream=True, extra_headers=RESUMABLE
        )
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == TEXT
    assert [e.type for e in events].count("response.completed") == 1
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))


def test_the_anthropic_sdk_reads_a_message_whole_across_two_cuts(server: ServerProcess) -> None:
    with (
        anthropic.Anthropic(
            base_url=server.base_url,
            api_key="unused",
            max_retries=0,
            http_client=httpx2.Client(transport=ResumingTransport(Cutter(), FAST)),
        ) as client,
        client.messages.stream(
            model="words", max_tokens=1000, messages=MESSAGES, extra_headers=RESUMABLE
        ) as stream,
    ):
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == TEXT
    assert final.stop_reason == "end_turn"


def test_the_async_openai_sdk_reads_chat_completions_whole_across_two_cuts(
    server: ServerProcess,
) -> None:
    async def run() -> str:
        cutter = Cutter()
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx2.AsyncClient(transport=AsyncResumingTransport(cutter, FAST)),
        ) as client:
            stream = await client.chat.completions.create(
                model="words", messages=MESSAGES, stream=True, extra_headers=RESUMABLE
            )
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert len(cutter.resumes) == 2
        return "".join(pieces)

    assert asyncio.run(run()) == TEXT
