"""The official ``anthropic`` SDK, unchanged, against a real ``sluice serve`` with the
bundled model: ``messages.stream`` (``text_stream``, ``get_final_message``), ``create``,
stop reasons, usage, and errors as the SDK's own exception types."""

from __future__ import annotations

import anthropic
import httpx
import pytest

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
