"""Tool calling through ``sluice serve --upstream``, driven by the official SDKs.

A scripted upstream (:class:`~tests.backends.scripted_upstream.ToolCallingModel`) plays a
tool-calling model: it answers 400 unless it receives exactly the tools, tool settings and
tool history it expects, calls a tool when asked the question, and answers once the
tool's result is in the history. The round trip (request with tools -> streamed tool call
-> tool result -> final answer) is run with the ``openai`` SDK and with the ``anthropic``
SDK, whose tools, ``tool_use`` and ``tool_result`` blocks reach the OpenAI-compatible
upstream in OpenAI's shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.backends.scripted_upstream import ThreadedUpstream, ToolCallingModel
from tests.server import ServerProcess

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "a city name"}},
    "required": ["city"],
    "additionalProperties": False,
}
DESCRIPTION = "The weather in a city now."
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA},
    }
]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA}]
SYSTEM = "Use the tools you are given."
QUESTION = "What is the weather in Paris?"
UPSTREAM_QUESTION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": QUESTION},
]
RESULT = "sunny, 21 C"
ANSWER = "It is sunny in Paris, 21 C."


@pytest.fixture(scope="module")
def upstream() -> Iterator[ThreadedUpstream]:
    with ThreadedUpstream() as server:
        yield server
        assert server.errors == []


@pytest.fixture(scope="module")
def proxy(upstream: ThreadedUpstream) -> Iterator[ServerProcess]:
    options = ["--no-model", "--upstream", upstream.base_url, "--upstream-model", "stub"]
    with ServerProcess(*options) as process:
        yield process.wait_ready()


@pytest.fixture
def model(upstream: ThreadedUpstream) -> ToolCallingModel:
    tool_model = ToolCallingModel(
        tools=OPENAI_TOOLS, question=UPSTREAM_QUESTION, result=RESULT, answer=ANSWER
    )
    upstream.script = tool_model
    upstream.requests.clear()
    return tool_model


def test_a_tool_call_round_trip_with_the_openai_sdk(
    proxy: ServerProcess, upstream: ThreadedUpstream, model: ToolCallingModel
) -> None:
    model.expected = {"tool_choice": "auto", "parallel_tool_calls": False}
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    with openai.OpenAI(base_url=f"{proxy.base_url}/v1", api_key="unused", max_retries=0) as client:
        fields: dict[str, Any] = {
            "model": "stub",
            "tools": OPENAI_TOOLS,
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "stream": True,
        }
        chunks = list(client.chat.completions.create(messages=messages, **fields))
        calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        first = calls[0].choices[0].delta.tool_calls[0]  # type: ignore[index]
        assert (first.id, first.type, first.function.name) == ("call_1", "function", "get_weather")  # type: ignore[union-attr]
        arguments = "".join(
            c.choices[0].delta.tool_calls[0].function.arguments or ""  # type: ignore[index, union-attr]
            for c in calls
        )
        assert json.loads(arguments) == {"city": "Paris"}

        function = {"name": first.function.name, "arguments": arguments}  # type: ignore[union-attr]
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": first.id, "type": "function", "function": function}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": first.id, "content": RESULT})
        final = list(client.chat.completions.create(messages=messages, **fields))
    assert "".join(c.choices[0].delta.content or "" for c in final if c.choices) == ANSWER
    assert final[-1].choices[0].finish_reason == "stop"
    received = [request.json() for request in upstream.requests]
    assert [body["messages"] for body in received] == [UPSTREAM_QUESTION, model.history()]
    assert all(body["tools"] == OPENAI_TOOLS for body in received)


def test_a_tool_call_round_trip_with_the_anthropic_sdk(
    proxy: ServerProcess, upstream: ThreadedUpstream, model: ToolCallingModel
) -> None:
    model.expected = {
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    }
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    fields: dict[str, Any] = {
        "model": "stub",
        "max_tokens": 200,
        "system": SYSTEM,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    }
    with anthropic.Anthropic(base_url=proxy.base_url, api_key="unused", max_retries=0) as client:
        with client.messages.stream(messages=messages, **fields) as stream:
            kinds = [event.type for event in stream]
            called = stream.get_final_message()
        assert "content_block_start" in kinds
        assert called.stop_reason == "tool_use"
        [block] = called.content
        assert block.type == "tool_use"
        assert (block.id, block.name, block.input) == ("call_1", "get_weather", {"city": "Paris"})

        messages.append({"role": "assistant", "content": called.content})
        result = {"type": "tool_result", "tool_use_id": block.id, "content": RESULT}
        messages.append({"role": "user", "content": [result]})
        with client.messages.stream(messages=messages, **fields) as stream:
            text = "".join(stream.text_stream)
            answered = stream.get_final_message()
    assert text == ANSWER
    assert answered.stop_reason == "end_turn"
    received = [request.json() for request in upstream.requests]
    assert [body["messages"] for body in received] == [UPSTREAM_QUESTION, model.history()]
    assert all(body["tools"] == OPENAI_TOOLS for body in received)


def test_every_tool_field_reaches_the_upstream_unchanged(
    proxy: ServerProcess, upstream: ThreadedUpstream, model: ToolCallingModel
) -> None:
    """Strict tools, a named tool choice, ``parallel_tool_calls`` and a JSON schema response
    format are sent on exactly, whole (``stream: false``) as well as streamed."""
    strict_tools = [
        {**OPENAI_TOOLS[0], "function": {**OPENAI_TOOLS[0]["function"], "strict": True}}
    ]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
    }
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    model.tools = strict_tools
    model.expected = {
        "tool_choice": tool_choice,
        "parallel_tool_calls": True,
        "response_format": response_format,
    }
    with openai.OpenAI(base_url=f"{proxy.base_url}/v1", api_key="unused", max_retries=0) as client:
        whole = client.chat.completions.create(
            model="stub",
            messages=UPSTREAM_QUESTION,  # type: ignore[arg-type]
            tools=strict_tools,  # type: ignore[arg-type]
            tool_choice=tool_choice,  # type: ignore[arg-type]
            parallel_tool_calls=True,
            response_format=response_format,  # type: ignore[arg-type]
        )
    assert whole.choices[0].finish_reason == "tool_calls"
    [call] = whole.choices[0].message.tool_calls  # type: ignore[misc]
    assert call.function.arguments == '{"city":"Paris"}'  # type: ignore[union-attr]
    [body] = [request.json() for request in upstream.requests]
    assert body["tools"] == strict_tools
    assert body["response_format"] == response_format
