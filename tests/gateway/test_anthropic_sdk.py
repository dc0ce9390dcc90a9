"""The official ``anthropic`` SDK, unchanged, against a real ``sluice serve`` with the
bundled model: ``messages.stream`` (``text_stream``, ``get_final_message``), ``create``,
stop reasons, usage, and errors as the SDK's own exception types."""

from __future__ import annotations

import anthropic
import httpx
import orjson
import pytest

from sluice.sse import Decoder
from tests.server import ServerProcess, wait_for_state

MODEL = "sluice-tiny"
MESSAGES = [{"role": "user", "content": "Return the number of items in a list."}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def test_stream_text_equals_the_final_message_and_create(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model=MODEL,
        max_tokens=10,
        messages=MESSAGES,
        system="You are terse.",
        extra_body={"temperature": 0},  # SDK 2.x dropped the parameter; the API keeps it
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text  # ten tokens of the bundled model (whitespace counts)
    assert final.role == "assistant"
    assert final.model == MODEL
    assert final.id.startswith("msg_")
    assert [block.type for block in final.content] == ["text"]
    assert final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10
    assert final.usage.input_tokens > 0

    created = client.messages.create(
        model=MODEL,
        max_tokens=10,
        messages=MESSAGES,
        system="You are terse.",
        extra_body={"temperature": 0},
    )
    assert created.content[0].text == text  # type: ignore[union-attr]
    assert created.stop_reason == "max_tokens"
    assert created.usage.output_tokens == 10

    # The second request hits the prefix cache: Anthropic counts those tokens apart.
    def prompt_tokens(usage: anthropic.types.Usage) -> int:
        return usage.input_tokens + (usage.cache_read_input_tokens or 0)

    assert prompt_tokens(created.usage) == prompt_tokens(final.usage)


def test_a_finished_answer_ends_its_turn(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="words", max_tokens=50, messages=[{"role": "user", "content": "all of it"}]
    )
    assert message.content[0].text == "all of it"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize(
    ("fields", "error", "needle"),
    [
        ({"model": "claude-9"}, anthropic.NotFoundError, "unknown model 'claude-9'"),
        ({"extra_body": {"temperature": 1.5}}, anthropic.BadRequestError, "temperature"),
        ({"messages": []}, anthropic.BadRequestError, "messages"),
        ({"max_tokens": 1000}, anthropic.BadRequestError, "exceeds max_model_len"),
    ],
)
def test_bad_requests_raise_the_sdks_own_errors(
    client: anthropic.Anthropic, fields: dict[str, object], error: type[Exception], needle: str
) -> None:
    body: dict[str, object] = {"model": MODEL, "max_tokens": 10, "messages": MESSAGES, **fields}
    with pytest.raises(error) as raised:
        client.messages.create(**body)  # type: ignore[arg-type]
    assert needle in str(raised.value)
    with pytest.raises(error), client.messages.stream(**body) as stream:  # type: ignore[arg-type]
        stream.get_final_message()


def test_errors_have_the_anthropic_shape(server: ServerProcess) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/messages", json={"model": MODEL, "messages": MESSAGES}
    )
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_leaving_the_stream_cancels_the_generation(
    client: anthropic.Anthropic, server: ServerProcess
) -> None:
    with client.messages.with_streaming_response.create(
        model=MODEL,
        max_tokens=200,
        messages=MESSAGES,
        stream=True,
        extra_body={"ignore_eos": True},  # not finished before the client leaves
    ) as response:
        stream_id = response.headers["x-sluice-stream-id"]
        for _, _event in zip(range(4), response.parse(), strict=False):
            pass
    described = wait_for_state(server, stream_id, "cancelled")
    assert described["tokens"] < 200


def test_a_stop_sequence_that_matched_is_the_stop_reason_with_its_string(
    client: anthropic.Anthropic,
) -> None:
    """On ``words`` and on the model: the text ends before the matched string, and both
    the streamed and the whole message say which one it was."""
    words = {"model": "words", "messages": [{"role": "user", "content": "one two. three"}]}
    with client.messages.stream(max_tokens=50, stop_sequences=["!", "."], **words) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == "one two"
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", ".")
    whole = client.messages.create(max_tokens=50, stop_sequences=["."], **words)  # type: ignore[arg-type]
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", ".")
    unmatched = client.messages.create(max_tokens=50, stop_sequences=["?"], **words)  # type: ignore[arg-type]
    assert (unmatched.stop_reason, unmatched.stop_sequence) == ("end_turn", None)

    greedy = {"model": MODEL, "messages": MESSAGES, "extra_body": {"temperature": 0}}
    free = client.messages.create(max_tokens=12, **greedy)  # type: ignore[arg-type]
    free_text = free.content[0].text  # type: ignore[union-attr]
    stop = free_text.strip()[len(free_text.strip()) // 2 :][:3]  # from the middle of it
    stopped = client.messages.create(max_tokens=12, stop_sequences=[stop], **greedy)  # type: ignore[arg-type]
    assert stopped.content[0].text == free_text[: free_text.index(stop)]  # type: ignore[union-attr]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)


@pytest.mark.parametrize("model", ["words", MODEL])
def test_message_start_carries_the_prompts_real_token_count(
    server: ServerProcess, model: str
) -> None:
    body = {"model": model, "max_tokens": 5, "messages": MESSAGES, "stream": True}
    events = Decoder().feed(httpx.post(f"{server.base_url}/v1/messages", json=body).content)
    start = orjson.loads(events[0].data)["message"]["usage"]
    end = orjson.loads(next(e.data for e in events if e.event == "message_delta"))["usage"]
    prompt_tokens = end["input_tokens"] + end.get("cache_read_input_tokens", 0)
    assert start == {"input_tokens": prompt_tokens, "output_tokens": 0}
    assert prompt_tokens > 0
    if model == "words":
        assert prompt_tokens == len(MESSAGES[0]["content"].split())


@pytest.mark.parametrize("model", ["words", MODEL])
def test_a_backend_that_cannot_call_tools_refuses_them_naming_the_field(
    client: anthropic.Anthropic, model: str
) -> None:
    tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    body: dict[str, object] = {"model": model, "max_tokens": 4, "messages": MESSAGES}
    with pytest.raises(anthropic.BadRequestError, match="tools:"):
        client.messages.create(tools=[tool], **body)  # type: ignore[arg-type, list-item]
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
        },
    ]
    with pytest.raises(anthropic.BadRequestError, match="messages:"):
        client.messages.create(**{**body, "messages": history})  # type: ignore[arg-type]
    # The model may not call a tool: it is not asked to, and answers.
    answer = client.messages.create(tools=[tool], tool_choice={"type": "none"}, **body)  # type: ignore[arg-type, list-item]
    assert answer.stop_reason in ("end_turn", "max_tokens")
