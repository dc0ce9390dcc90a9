"""The upstream backend against a scripted OpenAI-compatible server on 127.0.0.1.

Text (completions and chat), tool-call fragments, usage and finish reasons pass through;
the request sent upstream says what the request asked; every failure (status codes, bad
streams, in-band errors, drops, refused connections, timeouts) arrives as one of our own
errors naming the upstream URL and never the key. Nothing leaks when a generation is
aborted, closed by its consumer or cancelled: the upstream sees the disconnect, and the
next generation gets a fresh connection, while a completed one leaves its connection in
the pool for the next.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any, cast

import pytest

from sluice.backends.base import ChatMessage, Delta, GenerationRequest
from sluice.backends.upstream import UpstreamBackend, UpstreamGeneration
from sluice.errors import BackendError, BadRequestError, CapacityError, ConfigError
from sluice.events import Finished, FinishReason, TextDelta, ToolCallDelta, Usage
from sluice.streams import HubSettings, MemoryEventLog, StreamHub
from tests.backends.scripted_upstream import (
    DONE,
    Reply,
    ScriptedUpstream,
    UpstreamRequest,
    chat_chunk,
    completion_chunk,
    sse,
    usage_chunk,
)
from tests.streams.reading import read_until

pytestmark = pytest.mark.anyio

WAIT_S = 5.0  # the bound on every wait; tests pass in milliseconds
API_KEY = "sk-test-secret-0123456789"
PROMPT = GenerationRequest(prompt="Once upon")
CHAT = GenerationRequest(prompt="", messages=(ChatMessage("user", "Hi"),))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    server = await ScriptedUpstream().start()
    yield server
    await server.stop()
    assert server.errors == []


@pytest.fixture
async def backend(upstream: ScriptedUpstream) -> AsyncIterator[UpstreamBackend]:
    backend = UpstreamBackend("served", upstream.base_url, upstream_model="up", api_key=API_KEY)
    yield backend
    await backend.aclose()


async def collect(generation: UpstreamGeneration) -> list[Delta]:
    async with asyncio.timeout(WAIT_S):
        return [delta async for delta in generation]


async def collect_into(generation: UpstreamGeneration, received: list[Delta]) -> None:
    """Like :func:`collect`, keeping what arrived before an error."""
    async with asyncio.timeout(WAIT_S):
        async for delta in generation:
            received.append(delta)


def iterate(generation: UpstreamGeneration) -> AsyncGenerator[Delta, None]:
    """The generation's iterator, which is an async generator (it can be closed)."""
    return cast(AsyncGenerator[Delta, None], aiter(generation))


def texts(deltas: list[Delta]) -> str:
    return "".join(e.text for d in deltas for e in d.events if isinstance(e, TextDelta))


async def fails(generation: UpstreamGeneration, error: type[Exception]) -> Any:
    with pytest.raises(error) as info:
        await collect(generation)
    return info.value


# ---------------------------------------------------------------- streams that succeed


async def test_completions_stream_passes_text_finish_reason_and_usage(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.stream(
            sse(completion_chunk(" there")),
            sse(completion_chunk(" was", finish_reason="length")),
            sse(usage_chunk(3, 2, cached=1)),
        )

    upstream.script = script
    generation = backend.generate(PROMPT)
    deltas = await collect(generation)
    assert deltas == [
        Delta([TextDelta(" there")]),
        Delta([TextDelta(" was")], FinishReason.LENGTH),
    ]
    assert generation.usage() == Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    assert upstream.requests[0].path == "/v1/completions"


async def test_chat_stream_skips_role_chunk_and_passes_content(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.stream(
            sse(chat_chunk(role="assistant", content="")),
            sse(chat_chunk("Hello")),
            sse(chat_chunk(" 東京 🙂")),
            sse(chat_chunk(finish_reason="stop")),
        )

    upstream.script = script
    deltas = await collect(backend.generate(CHAT))
    assert texts(deltas) == "Hello 東京 🙂"
    assert deltas[-1] == Delta([], FinishReason.STOP)
    assert upstream.requests[0].path == "/v1/chat/completions"


async def test_tool_call_fragments_become_tool_call_deltas(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get"}}
    rest = {"index": 0, "function": {"arguments": '{"city": '}}
    last = {"index": 0, "function": {"arguments": '"Oslo"}'}}

    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.stream(
            sse(chat_chunk(tool_calls=[first])),
            sse(chat_chunk(tool_calls=[rest])),
            sse(chat_chunk(tool_calls=[last])),
            sse(chat_chunk(finish_reason="tool_calls")),
        )

    upstream.script = script
    generation = backend.generate(CHAT)
    deltas = await collect(generation)
    assert [e for d in deltas for e in d.events] == [
        ToolCallDelta(0, "", id="call_1", name="get"),
        ToolCallDelta(0, '{"city": '),
        ToolCallDelta(0, '"Oslo"}'),
    ]
    assert deltas[-1].finish_reason is FinishReason.TOOL_CALLS
    assert generation.usage() == Usage(prompt_tokens=0, completion_tokens=3)  # none reported


@pytest.mark.parametrize(
    ("upstream_reason", "reason"),
    [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("tool_calls", FinishReason.TOOL_CALLS),
        ("content_filter", FinishReason.STOP),
        ("eos_token", FinishReason.STOP),
        ("something_new", FinishReason.STOP),
    ],
)
async def test_finish_reasons_are_mapped(
    upstream: ScriptedUpstream,
    backend: UpstreamBackend,
    upstream_reason: str,
    reason: FinishReason,
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.stream(sse(completion_chunk("x", finish_reason=upstream_reason)))

    upstream.script = script
    assert await collect(backend.generate(PROMPT)) == [Delta([TextDelta("x")], reason)]


@pytest.mark.parametrize(
    ("stop_reason", "stop_sequence"), [("\n\n", "\n\n"), (50256, None), (None, None)]
)
async def test_vllms_stop_reason_string_is_the_stop_sequence(
    upstream: ScriptedUpstream,
    backend: UpstreamBackend,
    stop_reason: object,
    stop_sequence: str | None,
) -> None:
    """vLLM names the stop string (or stop token id) that ended the text in ``stop_reason``."""

    async def script(request: UpstreamRequest, reply: Reply) -> None:
        chunk = completion_chunk("x", finish_reason="stop")
        chunk["choices"][0]["stop_reason"] = stop_reason
        await reply.stream(sse(chunk))

    upstream.script = script
    assert await collect(backend.generate(PROMPT)) == [
        Delta([TextDelta("x")], FinishReason.STOP, stop_sequence)
    ]


async def test_vllm_abort_finish_reason_is_a_retryable_error(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.stream(sse(completion_chunk("", finish_reason="abort")))

    upstream.script = script
    error = await fails(backend.generate(PROMPT), BackendError)
    assert error.retryable
    assert "aborted" in str(error)


async def test_chunks_of_one_network_read_merge_into_one_delta(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.head()
        await reply.chunk(b"".join(sse(completion_chunk(w)) for w in ("a", "b", "c")) + DONE)
        await reply.end()

    upstream.script = script
    generation = backend.generate(PROMPT)
    deltas = await collect(generation)
    assert deltas == [Delta([TextDelta("a"), TextDelta("b"), TextDelta("c")])]
    assert generation.usage() == Usage(prompt_tokens=0, completion_tokens=3)


async def test_a_delta_is_not_held_back_waiting_for_more(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    """The upstream sends the rest only after the consumer got the first delta."""
    first_received = asyncio.Event()

    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.head()
        await reply.chunk(sse(completion_chunk("first")))
        await first_received.wait()
        await reply.chunk(sse(completion_chunk("", finish_reason="stop")) + DONE)
        await reply.end()

    upstream.script = script
    deltas: list[Delta] = []
    async with asyncio.timeout(WAIT_S):
        async for delta in backend.generate(PROMPT):
            deltas.append(delta)
            first_received.set()
    assert texts(deltas) == "first"
    assert deltas[-1].finish_reason is FinishReason.STOP


async def test_ending_after_finish_reason_without_done_ends_normally(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.head()
        await reply.chunk(sse(completion_chunk("x", finish_reason="stop")))
        reply.drop()

    upstream.script = script
    deltas = await collect(backend.generate(PROMPT))
    assert deltas == [Delta([TextDelta("x")], FinishReason.STOP)]


# ---------------------------------------------------------------- what is sent upstream


async def test_chat_request_body_carries_model_messages_and_sampling(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.stream(sse(chat_chunk(finish_reason="stop")))

    upstream.script = script
    request = GenerationRequest(
        prompt="ignored",
        messages=(ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")),
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=1,
        stop=("\n", "END"),
    )
    await collect(backend.generate(request))
    sent = upstream.requests[0]
    assert sent.method == "POST"
    assert sent.headers["authorization"] == f"Bearer {API_KEY}"
    assert sent.headers["content-type"] == "application/json"
    assert sent.json() == {
        "model": "up",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ],
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 1,
        "stop": ["\n", "END"],
    }


async def test_completions_body_leaves_unset_fields_out_and_sends_no_key_without_one(
    upstream: ScriptedUpstream,
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.stream(sse(completion_chunk("", finish_reason="stop")))

    upstream.script = script
    backend = UpstreamBackend("served", upstream.base_url + "/")
    try:
        await collect(backend.generate(PROMPT))
    finally:
        await backend.aclose()
    sent = upstream.requests[0]
    assert sent.path == "/v1/completions"
    assert "authorization" not in sent.headers
    assert sent.json() == {
        "model": "served",
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": "Once upon",
    }


async def test_nothing_is_sent_before_iteration_starts(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    generation = backend.generate(PROMPT)
    assert generation.usage() == Usage(prompt_tokens=0, completion_tokens=0)
    await generation.abort()
    assert await collect(generation) == []
    assert upstream.requests == []


async def test_start_returns_at_the_response_head_before_any_text(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    started = asyncio.Event()

    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.head()
        await started.wait()
        await reply.chunk(sse(completion_chunk("late", finish_reason="stop")) + DONE)
        await reply.end()

    upstream.script = script
    generation = backend.generate(PROMPT)
    async with asyncio.timeout(WAIT_S):
        await generation.start()
        await generation.start()  # once only
    started.set()
    assert texts(await collect(generation)) == "late"
    assert len(upstream.requests) == 1


async def test_start_raises_the_refusal(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.full(429, error_body("rate limited"), headers=(("retry-after", "3"),))

    upstream.script = script
    generation = backend.generate(PROMPT)
    with pytest.raises(CapacityError) as info:
        async with asyncio.timeout(WAIT_S):
            await generation.start()
    assert info.value.retry_after_s == 3.0
    await generation.abort()
    assert await collect(generation) == []


async def test_abort_after_start_disconnects_before_any_text(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    upstream.script = endless_script(asyncio.Event())
    generation = backend.generate(PROMPT)
    async with asyncio.timeout(WAIT_S):
        await generation.start()
        await generation.abort()
        await upstream.connections[0].closed.wait()
    assert await collect(generation) == []


async def test_a_generation_is_iterable_once(backend: UpstreamBackend) -> None:
    generation = backend.generate(PROMPT)
    await generation.abort()
    await collect(generation)
    with pytest.raises(RuntimeError, match="only once"):
        generation.__aiter__()


# ---------------------------------------------------------------- errors before the stream


def error_body(message: str) -> bytes:
    return b'{"error": {"message": "%s", "type": "invalid_request_error"}}' % message.encode()


@pytest.mark.parametrize("status", [400, 404, 409, 413, 422])
async def test_client_error_statuses_are_bad_requests_with_the_upstream_message(
    upstream: ScriptedUpstream, backend: UpstreamBackend, status: int
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.full(status, error_body("max_tokens is too large"))

    upstream.script = script
    error = await fails(backend.generate(PROMPT), BadRequestError)
    assert "max_tokens is too large" in str(error)
    assert str(status) in str(error)
    assert upstream.base_url in str(error)


async def test_plain_text_error_body_is_quoted_truncated(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.full(404, b"no such model " + b"x" * 5000, content_type="text/plain")

    upstream.script = script
    error = await fails(backend.generate(PROMPT), BadRequestError)
    assert "no such model" in str(error)
    assert len(str(error)) < 1000


@pytest.mark.parametrize("status", [401, 403])
async def test_refused_credentials_are_a_backend_error_without_the_key(
    upstream: ScriptedUpstream, backend: UpstreamBackend, status: int
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.full(status, error_body(f"Incorrect API key provided: {API_KEY}"))

    upstream.script = script
    error = await fails(backend.generate(PROMPT), BackendError)
    assert "refused our credentials" in str(error)
    assert not error.retryable
    assert API_KEY not in str(error)
    assert upstream.base_url in str(error)


@pytest.mark.parametrize(
    ("status", "headers", "retry_after_s"),
    [
        (429, (("retry-after", "7"),), 7.0),
        (503, (("retry-after", "2"),), 2.0),
        (503, (), 1.0),
        (429, (("retry-after", "soon"),), 1.0),
    ],
)
async def test_capacity_statuses_are_capacity_errors_with_retry_after(
    upstream: ScriptedUpstream,
    backend: UpstreamBackend,
    status: int,
    headers: tuple[tuple[str, str], ...],
    retry_after_s: float,
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.full(status, error_body("busy"), headers=headers)

    upstream.script = script
    error = await fails(backend.generate(PROMPT), CapacityError)
    assert error.retry_after_s == retry_after_s
    assert "busy" in str(error)


@pytest.mark.parametrize("status", [500, 502, 504])
async def test_server_error_statuses_are_retryable_backend_errors(
    upstream: ScriptedUpstream, backend: UpstreamBackend, status: int
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.full(status, b"Internal Server Error", content_type="text/plain")

    upstream.script = script
    error = await fails(backend.generate(PROMPT), BackendError)
    assert error.retryable
    assert str(status) in str(error)


async def test_json_answer_to_a_stream_request_is_a_backend_error(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.full(200, b'{"choices": [{"text": "all at once"}]}')

    upstream.script = script
    error = await fails(backend.generate(PROMPT), BackendError)
    assert "not an event stream" in str(error)


async def test_refused_connection_is_a_retryable_backend_error() -> None:
    with socket.socket() as unused:  # bound, never listening: connections are refused
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}/v1"
        backend = UpstreamBackend("served", url)
        try:
            error = await fails(backend.generate(PROMPT), BackendError)
        finally:
            await backend.aclose()
    assert error.retryable
    assert "cannot connect" in str(error)
    assert url in str(error)


async def test_silent_upstream_hits_the_read_timeout_and_sees_the_disconnect(
    upstream: ScriptedUpstream,
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await request.connection.closed.wait()  # never answers

    upstream.script = script
    backend = UpstreamBackend("served", upstream.base_url, read_timeout_s=0.2)
    try:
        error = await fails(backend.generate(PROMPT), BackendError)
    finally:
        await backend.aclose()
    assert error.retryable
    assert "sent nothing for 0.2 s" in str(error)
    async with asyncio.timeout(WAIT_S):
        await upstream.connections[0].closed.wait()


async def test_busy_pool_is_a_capacity_error(upstream: ScriptedUpstream) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.head()
        await reply.chunk(sse(completion_chunk("held")))
        await request.connection.closed.wait()

    upstream.script = script
    backend = UpstreamBackend("served", upstream.base_url, max_connections=1, connect_timeout_s=0.2)
    try:
        holder = backend.generate(PROMPT)
        async with asyncio.timeout(WAIT_S), aclosing(iterate(holder)) as deltas:
            await anext(deltas)  # the only connection is now busy
            error = await fails(backend.generate(PROMPT), CapacityError)
    finally:
        await backend.aclose()
    assert "busy" in str(error)


# ---------------------------------------------------------------- errors inside the stream


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"data: " + b"x" * 200, "longer than 64 bytes"),
        (b"".join(b"data: " + b"y" * 50 + b"\n" for _ in range(4)), "longer than 128 characters"),
        (b"data: hello\n\n", "not JSON"),
        (b"data: [1, 2]\n\n", "not a JSON object"),
        (b'data: {"id": "x"}\n\n', "without choices"),
        (b'data: {"choices": [{"index": 0}]}\n\n', "without text"),
        (b'data: {"choices": [{"text": 5}]}\n\n', "without text"),
        (b'data: {"choices": [], "usage": {"prompt_tokens": "3"}}\n\n', "usage"),
    ],
)
async def test_malformed_streams_are_backend_errors(
    upstream: ScriptedUpstream, body: bytes, message: str
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.stream(body)

    upstream.script = script
    backend = UpstreamBackend("served", upstream.base_url, max_line_bytes=64, max_event_chars=128)
    try:
        error = await fails(backend.generate(PROMPT), BackendError)
    finally:
        await backend.aclose()
    assert message in str(error)
    assert upstream.base_url in str(error)
    assert not error.retryable


async def test_chat_choice_without_delta_is_a_backend_error(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.stream(sse({"choices": [{"index": 0, "text": "completions shape"}]}))

    upstream.script = script
    error = await fails(backend.generate(CHAT), BackendError)
    assert "without a delta" in str(error)


@pytest.mark.parametrize(("code", "retryable"), [(500, True), (400, False)])
async def test_in_band_error_is_a_backend_error_with_its_message(
    upstream: ScriptedUpstream, backend: UpstreamBackend, code: int, retryable: bool
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        error = {"error": {"message": "the engine fell over", "code": code}}
        await reply.stream(sse(completion_chunk("partial")), sse(error))

    upstream.script = script
    received: list[Delta] = []
    with pytest.raises(BackendError) as info:
        await collect_into(backend.generate(PROMPT), received)
    assert texts(received) == "partial"
    assert "the engine fell over" in str(info.value)
    assert info.value.retryable is retryable


async def test_drop_before_finish_is_a_retryable_error_after_the_text_so_far(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.head()
        await reply.chunk(sse(completion_chunk("partial")))
        reply.drop()

    upstream.script = script
    received: list[Delta] = []
    with pytest.raises(BackendError) as info:
        await collect_into(backend.generate(PROMPT), received)
    assert texts(received) == "partial"
    assert "closed the stream before it finished" in str(info.value)
    assert info.value.retryable


async def test_clean_end_without_done_or_finish_reason_is_a_retryable_error(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.stream(sse(completion_chunk("partial")), done=False)

    upstream.script = script
    error = await fails(backend.generate(PROMPT), BackendError)
    assert "closed the stream before it finished" in str(error)
    assert error.retryable


# ---------------------------------------------------------------- connections and aborts


def endless_script(first_chunk_sent: asyncio.Event) -> Any:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await reply.head()
        await reply.chunk(sse(completion_chunk("tick")))
        first_chunk_sent.set()
        await request.connection.closed.wait()  # an engine streaming until the client leaves

    return script


async def finish_script(request: UpstreamRequest, reply: Reply) -> None:
    await reply.stream(sse(completion_chunk("done", finish_reason="stop")))


async def test_completed_generation_leaves_its_connection_for_the_next(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    upstream.script = finish_script
    await collect(backend.generate(PROMPT))
    await collect(backend.generate(PROMPT))
    assert [r.connection.number for r in upstream.requests] == [0, 0]


async def test_abort_mid_stream_disconnects_and_the_next_generation_connects_afresh(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    upstream.script = endless_script(asyncio.Event())
    generation = backend.generate(PROMPT)
    async with asyncio.timeout(WAIT_S):
        deltas = aiter(generation)
        assert await anext(deltas) == Delta([TextDelta("tick")])
        await generation.abort()
        await upstream.connections[0].closed.wait()
        assert [d async for d in deltas] == []  # ends quietly after an abort
        await generation.abort()  # idempotent
    assert generation.usage() == Usage(prompt_tokens=0, completion_tokens=1)

    upstream.script = finish_script
    assert texts(await collect(backend.generate(PROMPT))) == "done"
    assert [r.connection.number for r in upstream.requests] == [0, 1]


async def test_abort_from_another_task_ends_an_iteration_waiting_for_data(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    upstream.script = endless_script(asyncio.Event())
    generation = backend.generate(PROMPT)
    received: list[Delta] = []
    first_received = asyncio.Event()

    async def consume() -> None:
        async for delta in generation:
            received.append(delta)
            first_received.set()

    async with asyncio.timeout(WAIT_S):
        consumer = asyncio.create_task(consume())
        await first_received.wait()  # the consumer runs on into its next read meanwhile
        await generation.abort()
        await consumer  # ends without an error: the abort was ours
        await upstream.connections[0].closed.wait()
    assert texts(received) == "tick"


async def test_abort_while_waiting_for_the_response_head(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    async def script(request: UpstreamRequest, reply: Reply) -> None:
        await request.connection.closed.wait()  # never answers

    upstream.script = script
    generation = backend.generate(PROMPT)
    async with asyncio.timeout(WAIT_S):
        consumer = asyncio.create_task(collect(generation))
        await upstream.request_seen.wait()
        await generation.abort()
        assert await consumer == []
        await upstream.connections[0].closed.wait()


async def test_consumer_closing_the_iteration_closes_the_upstream_connection(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    upstream.script = endless_script(asyncio.Event())
    async with asyncio.timeout(WAIT_S):
        async with aclosing(iterate(backend.generate(PROMPT))) as deltas:
            await anext(deltas)
        await upstream.connections[0].closed.wait()


async def test_cancelled_consumer_task_closes_the_upstream_connection(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    first_chunk_sent = asyncio.Event()
    upstream.script = endless_script(first_chunk_sent)
    generation = backend.generate(PROMPT)
    async with asyncio.timeout(WAIT_S):
        consumer = asyncio.create_task(collect(generation))
        await first_chunk_sent.wait()
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await upstream.connections[0].closed.wait()
        await generation.abort()  # after the end: still safe


async def test_hub_cancel_mid_stream_disconnects_upstream_and_records_usage(
    upstream: ScriptedUpstream, backend: UpstreamBackend
) -> None:
    upstream.script = endless_script(asyncio.Event())
    hub = StreamHub(MemoryEventLog(), {"served": backend}, HubSettings(default_grace_s=5.0))
    async with hub.running():
        stream = await hub.create("served", PROMPT)
        reader = hub.open_reader(stream.id, 0)
        events = await read_until(reader, lambda seen: TextDelta("tick") in seen, WAIT_S)
        hub.cancel(stream.id)
        events += await read_until(reader, lambda seen: reader.done, WAIT_S)
        async with asyncio.timeout(WAIT_S):
            await upstream.connections[0].closed.wait()
    assert events[-2:] == [
        Usage(prompt_tokens=0, completion_tokens=1),
        Finished(FinishReason.CANCELLED),
    ]


async def test_backend_close_ends_with_a_closed_error(backend: UpstreamBackend) -> None:
    await backend.aclose()
    error = await fails(backend.generate(PROMPT), BackendError)
    assert "closed" in str(error)


# ---------------------------------------------------------------- configuration


def bad_configs() -> Iterator[dict[str, Any]]:
    yield {"base_url": "ftp://example.com/v1"}
    yield {"base_url": "not a url"}
    yield {"connect_timeout_s": 0}
    yield {"read_timeout_s": -1.0}
    yield {"max_connections": 0}
    yield {"max_line_bytes": 0}
    yield {"api_key": "sk-line\nbreak"}


@pytest.mark.parametrize("overrides", list(bad_configs()))
def test_unworkable_settings_are_config_errors(overrides: dict[str, Any]) -> None:
    settings: dict[str, Any] = {"base_url": "http://127.0.0.1:1/v1", **overrides}
    with pytest.raises(ConfigError) as info:
        UpstreamBackend("served", **settings)
    assert "sk-line" not in str(info.value)


async def test_model_is_the_served_name(backend: UpstreamBackend) -> None:
    assert backend.model == "served"
