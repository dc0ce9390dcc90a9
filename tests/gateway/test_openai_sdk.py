"""The official ``openai`` SDK, unchanged, against a real ``sluice serve`` with the bundled
model: streaming and not, chat and completions, usage, finish reasons, errors as the SDK's
own exception types, cancellation on disconnect, and opt-in resumable streams."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from sluice.sse import Decoder
from tests.server import ServerProcess, wait_for_state

MODEL = "sluice-tiny"
MESSAGES = [{"role": "user", "content": "What does socket.connect do?"}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_chat_stream_with_usage_has_role_text_finish_reason_and_usage(
    client: openai.OpenAI,
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            max_tokens=8,
            temperature=0,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].id.startswith("chatcmpl-")
    assert all(c.model == MODEL and c.object == "chat.completion.chunk" for c in chunks)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 8
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 8
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()

    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 8
    assert whole.usage.prompt_tokens == usage.prompt_tokens


def test_completions_match_the_native_api_and_stop_strings_end_with_stop(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    prompt = "Return the number of"
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"

    native = httpx.post(
        f"{server.base_url}/v1/streams",
        json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
    ).json()
    raw = httpx.get(f"{server.base_url}{native['events_url']}", timeout=30).content
    tokens = [orjson.loads(e.data)["text"] for e in Decoder().feed(raw) if e.event == "token"]
    assert text == "".join(tokens)

    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == text

    stop = text.strip()[len(text.strip()) // 2 :][:3]  # three characters from the middle
    stopped = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_the_words_model_answers_a_chat_with_its_last_message(client: openai.OpenAI) -> None:
    chunks = client.chat.completions.create(
        model="words", messages=[{"role": "user", "content": "one two  three"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two  three"


@pytest.mark.parametrize(
    ("fields", "error", "needle"),
    [
        ({"model": "gpt-9"}, openai.NotFoundError, "unknown model 'gpt-9'"),
        ({"temperature": 5}, openai.BadRequestError, "temperature"),
        ({"n": 2}, openai.BadRequestError, "n:"),
        ({"messages": []}, openai.BadRequestError, "messages"),
        ({"max_tokens": 100_000}, openai.BadRequestError, "max_tokens"),
        # Fits the server's bounds but not the model's 256 positions: refused at admission.
        ({"max_tokens": 1000}, openai.BadRequestError, "exceeds max_model_len"),
    ],
)
def test_bad_requests_raise_the_sdks_own_errors(
    client: openai.OpenAI, fields: dict[str, object], error: type[Exception], needle: str
) -> None:
    body: dict[str, object] = {"model": MODEL, "messages": MESSAGES, **fields}
    for stream in (False, True):
        with pytest.raises(error) as raised:
            client.chat.completions.create(stream=stream, **body)  # type: ignore[call-overload]
        assert needle in str(raised.value)


def test_malformed_json_gets_an_openai_error_body(server: ServerProcess) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "malformed JSON" in error["message"]


def test_closing_the_stream_cancels_the_generation(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        max_tokens=200,
        extra_body={"ignore_eos": True},  # not finished before the client leaves
    ) as response:
        stream_id = response.headers["x-sluice-stream-id"]
        chunks = response.parse()
        for _, _chunk in zip(range(3), chunks, strict=False):
            pass
    described = wait_for_state(server, stream_id, "cancelled")
    assert described["tokens"] < 200


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CALL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.mark.parametrize("model", ["words", MODEL])
@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tools": TOOLS}, "tools:"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tools:"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tools:"),
        ({"tool_choice": "required"}, "tool_choice:"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice:"),
        ({"response_format": {"type": "json_object"}}, "response_format:"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format:",
        ),
        ({"messages": TOOL_CALL_HISTORY}, "messages:"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions:"),
    ],
)
def test_a_backend_that_cannot_call_tools_refuses_them_naming_the_field(
    client: openai.OpenAI, model: str, fields: dict[str, object], needle: str
) -> None:
    body: dict[str, object] = {"model": model, "messages": MESSAGES, "max_tokens": 4, **fields}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(stream=stream, **body)  # type: ignore[call-overload]
        assert needle in str(raised.value)


def test_tools_the_model_must_not_call_and_a_text_format_are_honoured_by_words(
    client: openai.OpenAI,
) -> None:
    answer = client.chat.completions.create(
        model="words",
        messages=[{"role": "user", "content": "no tools here"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        response_format={"type": "text"},
    )
    assert answer.choices[0].message.content == "no tools here"


def test_the_words_model_honours_stop_strings_like_a_model(client: openai.OpenAI) -> None:
    chunks = client.chat.completions.create(
        model="words",
        messages=[{"role": "user", "content": "one two three. four"}],
        stop=["three", "two"],
        stream=True,
    )
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.delta.content or "" for p in parts) == "one "
    assert parts[-1].finish_reason == "stop"

    whole = client.completions.create(model="words", prompt="one two three. four", stop=".")
    assert whole.choices[0].text == "one two three"
    assert whole.choices[0].finish_reason == "stop"
