"""The OpenAI Responses API (``POST /v1/responses``) driven by the official ``openai`` SDK,
unchanged, against a real ``sluice serve``: streamed text equal to the whole response,
usage, the stream helper's strict event order, cancellation by closing the SDK's stream,
an outside cancel as the SDK's error events, bad requests as the SDK's own exceptions,
resumable streams resumed in the Responses dialect, and a tool call round trip through
an upstream."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai import omit
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from sluice.sse import Decoder, Event
from tests.backends.scripted_upstream import ThreadedUpstream, ToolCallingModel
from tests.rawhttp import open_get
from tests.server import ServerProcess, wait_for_state

MODEL = "sluice-tiny"
PROMPT = "What does socket.connect do?"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def stream_id_of(response_id: str) -> str:
    """The stream behind a response: its id is the stream id under the dialect's prefix."""
    return "str_" + response_id.removeprefix("resp_")


def replay(payloads: Sequence[dict[str, Any]]) -> ResponseStreamState[Any]:
    """The SDK's own stream state fed ``payloads``: it raises on an event out of order."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for payload in payloads:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=payload))  # type: ignore[arg-type]
    return state


def test_streamed_text_equals_the_whole_response_and_both_report_usage(
    client: openai.OpenAI,
) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "instructions": "Answer briefly.",
        "input": PROMPT,
        "max_output_tokens": 8,
        "temperature": 0,
    }
    events = list(client.responses.create(stream=True, **fields))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip()
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    streamed = last.response  # type: ignore[union-attr]
    assert streamed.output_text == text
    assert streamed.instructions == "Answer briefly."
    assert streamed.usage is not None
    assert streamed.usage.input_tokens > 0
    assert 0 < streamed.usage.output_tokens <= 8

    whole = client.responses.create(**fields)
    assert whole.object == "response"
    assert whole.id.startswith("resp_")
    assert whole.output_text == text
    assert whole.status == streamed.status
    assert whole.usage is not None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        streamed.usage.input_tokens,
        streamed.usage.output_tokens,
    )


def test_a_length_cut_ends_incomplete_and_a_stop_completes(client: openai.OpenAI) -> None:
    cut = client.responses.create(
        model=MODEL, input=PROMPT, max_output_tokens=4, extra_body={"ignore_eos": True}
    )
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None
    assert cut.usage.output_tokens == 4
    done = client.responses.create(model="words", input="one two  three")
    assert (done.status, done.output_text) == ("completed", "one two  three")


def test_the_stream_helper_accepts_the_event_order_and_returns_the_final_response(
    client: openai.OpenAI,
) -> None:
    items: Any = [
        {"role": "developer", "content": "Echo."},
        {"role": "user", "content": [{"type": "input_text", "text": "alpha beta  gamma"}]},
    ]
    with client.responses.stream(model="words", input=items) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed"
    assert "response.output_text.done" in kinds
    assert final.output_text == "alpha beta  gamma"
    assert final.usage is not None
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens


def test_closing_the_sdk_stream_cancels_the_generation(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "input": PROMPT,
        "max_output_tokens": 200,
        "extra_body": {"ignore_eos": True},  # not finished before the client leaves
    }
    with client.responses.with_streaming_response.create(stream=True, **fields) as response:
        stream_id = response.headers["x-sluice-stream-id"]
        for _, _event in zip(range(6), response.parse(), strict=False):
            pass
    assert wait_for_state(server, stream_id, "cancelled")["tokens"] < 200

    with client.responses.stream(**fields) as helper:
        for event in helper:
            if event.type == "response.created":
                stream_id = stream_id_of(event.response.id)
            if event.type == "response.output_text.delta":
                break
    assert wait_for_state(server, stream_id, "cancelled")["tokens"] < 200


def test_an_outside_cancel_reaches_the_sdk_as_its_error_events(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    stream = client.responses.create(
        model=MODEL,
        input=PROMPT,
        max_output_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta":
            stream_id = stream_id_of(events[0].response.id)  # type: ignore[union-attr]
            cancelled = httpx.post(f"{server.base_url}/v1/streams/{stream_id}/cancel")
            assert cancelled.status_code == 202, cancelled.text
            break
    events.extend(stream)  # the rest, up to the end the cancel brings
    error, failed = events[-2:]
    assert error.type == "error"
    assert error.code == "cancelled"
    assert failed.type == "response.failed"
    assert failed.response.status == "cancelled"
    assert failed.response.error is not None
    assert failed.response.error.message == error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    replay([e.to_dict() for e in events])  # a lifecycle the SDK's helper accepts


@pytest.mark.parametrize(
    ("fields", "error", "param"),
    [
        ({"model": "gpt-9"}, openai.NotFoundError, None),
        ({"temperature": 5}, openai.BadRequestError, "temperature"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            openai.BadRequestError,
            "input.0.content.0.type",
        ),
        ({"tools": [{"type": "web_search"}]}, openai.BadRequestError, "tools.0.type"),
        ({"previous_response_id": "resp_1"}, openai.BadRequestError, "previous_response_id"),
        ({"max_output_tokens": 10**7}, openai.BadRequestError, "max_output_tokens"),
    ],
)
def test_bad_requests_raise_the_sdks_own_errors_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], error: type[openai.APIError], param: str | None
) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": PROMPT, **fields}
    for stream in (False, True):
        with pytest.raises(error) as raised:
            client.responses.create(stream=stream, **body)
        assert raised.value.param == param
        if param is not None:
            assert param in raised.value.message


def test_tools_for_a_model_that_cannot_call_them_are_refused_naming_them(
    client: openai.OpenAI,
) -> None:
    tool: Any = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.responses.create(model=MODEL, input=PROMPT, tools=[tool], stream=True)


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


def test_a_resumable_stream_resumes_from_every_frame_in_the_responses_dialect(
    server: ServerProcess,
) -> None:
    body = {"model": "words", "input": "one two  three four", "stream": True}
    response = httpx.post(
        f"{server.base_url}/v1/responses", json=body, headers={"X-Sluice-Resumable": "true"}
    )
    assert response.status_code == 200
    stream_id = response.headers["x-sluice-stream-id"]
    frames = Decoder().feed(response.content)
    assert all(f.id.startswith(f"{stream_id}:") for f in frames)
    assert len({f.id for f in frames}) == len(frames)
    payloads = [orjson.loads(f.data) for f in frames]
    assert [f.event for f in frames] == [p["type"] for p in payloads]
    assert [p["sequence_number"] for p in payloads] == list(range(len(frames)))
    replay(payloads)
    wait_for_state(server, stream_id, "finished")
    events_path = f"/v1/streams/{stream_id}/events"
    assert _read(server, events_path, None) == frames  # a fresh read replays it all
    for i, frame in enumerate(frames):
        rest = _read(server, events_path, frame.id)
        assert frames[: i + 1] + rest == frames, f"resumed after frame {i} ({frame.id})"


def test_a_resumable_stream_cut_midway_resumes_with_nothing_missing_or_repeated(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    """A client reads a resumable stream and leaves midway; the stream lives on (grace),
    and a resume from the last frame the client saw gives the rest: sequence numbers run
    0..n without a gap, the SDK's stream state accepts the whole, and the text is the
    whole response's (greedy)."""
    path = f"{server.base_url}/v1/responses"
    fields = {"model": MODEL, "input": PROMPT, "max_output_tokens": 24, "temperature": 0}
    body = {**fields, "stream": True, "ignore_eos": True}
    seen: list[Event] = []
    decoder = Decoder()
    with httpx.stream(
        "POST", path, json=body, headers={"X-Sluice-Resumable": "true"}, timeout=30
    ) as response:
        stream_id = response.headers["x-sluice-stream-id"]
        for chunk in response.iter_raw():
            seen.extend(decoder.feed(chunk))
            if sum(e.event == "response.output_text.delta" for e in seen) >= 3:
                break
    rest = _read(server, f"/v1/streams/{stream_id}/events", seen[-1].id)
    payloads = [orjson.loads(e.data) for e in [*seen, *rest]]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    replay(payloads)
    assert payloads[-1]["type"] == "response.incomplete"
    streamed = "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")
    whole = client.responses.create(**fields, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    assert streamed == whole.output_text


# -- tools through an upstream ----------------------------------------------------------------

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
DESCRIPTION = "The weather in a city now."
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA},
    }
]
RESPONSES_TOOLS: Any = [
    {"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA}
]
SYSTEM = "Use the tools you are given."
QUESTION = "What is the weather in Paris?"
RESULT = "sunny, 21 C"
ANSWER = "It is sunny in Paris, 21 C."


@pytest.fixture(scope="module")
def upstream() -> Iterator[ThreadedUpstream]:
    with ThreadedUpstream() as upstream_server:
        yield upstream_server
        assert upstream_server.errors == []


@pytest.fixture(scope="module")
def proxy(upstream: ThreadedUpstream) -> Iterator[ServerProcess]:
    options = ["--no-model", "--upstream", upstream.base_url, "--upstream-model", "stub"]
    with ServerProcess(*options) as process:
        yield process.wait_ready()


def test_a_tool_call_round_trip_with_the_responses_api(
    proxy: ServerProcess, upstream: ThreadedUpstream
) -> None:
    """Function tools, ``function_call`` and ``function_call_output`` items reach an
    OpenAI-compatible upstream as the chat API's tools, tool calls and tool messages."""
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    upstream.script = ToolCallingModel(
        tools=CHAT_TOOLS,
        question=question,
        result=RESULT,
        answer=ANSWER,
        expected={"tool_choice": "auto", "parallel_tool_calls": False},
    )
    upstream.requests.clear()
    fields: dict[str, Any] = {
        "model": "stub",
        "instructions": SYSTEM,
        "tools": RESPONSES_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
    }
    with openai.OpenAI(base_url=f"{proxy.base_url}/v1", api_key="unused", max_retries=0) as sdk:
        with sdk.responses.stream(input=QUESTION, **fields) as stream:
            kinds = [event.type for event in stream]
            called = stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        [call] = called.output
        assert call.type == "function_call"
        assert (call.call_id, call.name) == ("call_1", "get_weather")
        assert json.loads(call.arguments) == {"city": "Paris"}

        items: Any = [
            {"role": "user", "content": QUESTION},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
        ]
        answered = sdk.responses.create(input=items, **fields)
    assert answered.output_text == ANSWER
    assert answered.status == "completed"
    received = [request.json() for request in upstream.requests]
    assert [body["tools"] for body in received] == [CHAT_TOOLS, CHAT_TOOLS]
    assert received[1]["messages"][2]["tool_calls"][0]["id"] == "call_1"
    assert received[1]["messages"][3] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": RESULT,
    }
