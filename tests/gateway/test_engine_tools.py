"""Tool calling on the embedded engine, against a real ``sluice serve``, with the SDKs.

The model is :mod:`tests.engine.tool_model`'s, built here: a tiny Llama checkpoint whose
greedy answer to any ChatML prompt is ``Let me check the weather.`` and a Hermes-style
``<tool_call>`` for ``get_weather`` with ``{"city": "Paris"}``, in a Hermes-style template
that renders ``tools``. The ``openai`` SDK (streamed and whole) gets ``tool_calls`` with
``finish_reason: tool_calls``; the ``anthropic`` SDK a text block, a ``tool_use`` block and
``stop_reason: tool_use``; the Responses API a ``function_call`` item; a history holding the call and its result is rendered and
answered. ``sluice-tiny`` (no chat template: the simple one, which renders no tools)
answers a request with tools ``400`` naming ``tools``, in each dialect's error shape,
streamed or not, before any response starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.engine.tool_model import ARGUMENTS, PREAMBLE, TOOL_NAME, write_tool_model
from tests.server import ServerProcess

pytestmark = pytest.mark.timeout(120)

MODEL = "hermes-tiny"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
OPENAI_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": TOOL_NAME, "description": "The weather now.", "parameters": SCHEMA},
    }
]
ANTHROPIC_TOOLS: list[Any] = [
    {"name": TOOL_NAME, "description": "The weather now.", "input_schema": SCHEMA}
]
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory: Path = write_tool_model(tmp_path_factory.mktemp("tools") / MODEL)
    with ServerProcess("--model", str(directory), "--kv-blocks", "256") as process:
        yield process.wait_ready()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_the_openai_sdk_streams_the_engines_tool_call(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=OPENAI_TOOLS, temperature=0, stream=True
        )
    )
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert "".join(choice.delta.content or "" for choice in choices) == PREAMBLE
    deltas = [call for choice in choices for call in choice.delta.tool_calls or ()]
    assert deltas[0].index == 0
    assert deltas[0].type == "function"
    assert deltas[0].id is not None
    assert deltas[0].id.startswith("call_")
    assert deltas[0].function is not None
    assert deltas[0].function.name == TOOL_NAME
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function is not None)
    assert json.loads(arguments) == ARGUMENTS
    assert choices[-1].finish_reason == "tool_calls"


def test_the_openai_sdk_gets_the_tool_call_whole(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=OPENAI_TOOLS, tool_choice="auto", temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == PREAMBLE
    [call] = choice.message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == TOOL_NAME
    assert json.loads(call.function.arguments) == ARGUMENTS


def test_a_history_with_the_call_and_its_result_is_answered(client: openai.OpenAI) -> None:
    called = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=OPENAI_TOOLS, temperature=0
    )
    [call] = called.choices[0].message.tool_calls or []
    function = {"name": call.function.name, "arguments": call.function.arguments}  # type: ignore[union-attr]
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, **_fn(function)}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=OPENAI_TOOLS, temperature=0
    )
    # The model (a lookup table) calls the tool again; the history was taken and rendered:
    # its prompt is the longer one.
    assert answer.choices[0].finish_reason == "tool_calls"
    assert answer.usage is not None
    assert called.usage is not None
    assert answer.usage.prompt_tokens > called.usage.prompt_tokens + len("sunny, 21 C")


def _fn(function: dict[str, str]) -> dict[str, Any]:
    return {"type": "function", "function": function}


def test_tools_the_model_must_not_call_are_not_parsed(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=OPENAI_TOOLS, tool_choice="none", temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.tool_calls is None
    assert choice.message.content is not None
    assert choice.message.content.startswith(PREAMBLE + "\n<tool_call>")


def test_the_anthropic_sdk_gets_a_tool_use_block(server: ServerProcess) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": QUESTION,
        "tools": ANTHROPIC_TOOLS,
    }
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        with client.messages.stream(**fields) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        whole = client.messages.create(**fields)
    assert "input_json" in kinds
    for message in (streamed, whole):
        assert message.stop_reason == "tool_use"
        text, tool_use = message.content
        assert isinstance(text, anthropic.types.TextBlock)
        assert text.text == PREAMBLE
        assert isinstance(tool_use, anthropic.types.ToolUseBlock)
        assert tool_use.name == TOOL_NAME
        assert tool_use.input == ARGUMENTS
        assert tool_use.id.startswith("call_")


def test_the_responses_api_gets_a_function_call_item(client: openai.OpenAI) -> None:
    tools: list[Any] = [{"type": "function", "name": TOOL_NAME, "parameters": SCHEMA}]
    whole = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools)
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=tools) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        assert response.status == "completed"
        message, call = response.output
        assert message.type == "message"
        assert call.type == "function_call"
        assert call.name == TOOL_NAME
        assert json.loads(call.arguments) == ARGUMENTS


@pytest.fixture(scope="module")
def tiny() -> Iterator[ServerProcess]:
    with ServerProcess() as process:  # sluice-tiny: the simple template, no tools
        yield process.wait_ready()


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_whose_template_renders_no_tools_answers_400_naming_tools(
    tiny: ServerProcess, stream: bool
) -> None:
    body = {"model": "sluice-tiny", "max_tokens": 4, "messages": QUESTION, "stream": stream}
    openai_answer = httpx.post(
        f"{tiny.base_url}/v1/chat/completions", json={**body, "tools": OPENAI_TOOLS}
    )
    assert openai_answer.status_code == 400
    error = openai_answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("tools: ")
    anthropic_answer = httpx.post(
        f"{tiny.base_url}/v1/messages", json={**body, "tools": ANTHROPIC_TOOLS}
    )
    assert anthropic_answer.status_code == 400
    refused = anthropic_answer.json()
    assert refused["type"] == "error"
    assert refused["error"]["type"] == "invalid_request_error"
    assert refused["error"]["message"].startswith("tools: ")
