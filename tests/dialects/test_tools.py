"""Tool fields of the compatible request bodies, parsed into neutral values and sent to an
upstream as OpenAI's shape (pure: no server). The JSON the client wrote reaches the
upstream body unchanged, whichever dialect it came in; bad tool fields are 400s naming them.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from sluice.backends.base import (
    MAX_TOOLS,
    ChatMessage,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from sluice.backends.upstream_body import request_body
from sluice.dialects.base import RequestLimits
from sluice.dialects.requests import parse_anthropic_messages, parse_openai
from sluice.errors import InvalidParameterError

SETTINGS = RequestLimits()
# Key order, floats, unicode and nesting as a client may write them.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["city"],
    "properties": {"city": {"type": "string", "description": "ville, 城市"}, "n": {"maximum": 1.5}},
}
OPENAI_TOOL = {
    "type": "function",
    "function": {"name": "w", "description": "d", "parameters": SCHEMA},
}
CALL = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}


def openai_chat(**fields: object) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_openai(body, SETTINGS, chat=True).generation  # type: ignore[return-value]


def upstream(generation: object) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(request_body(generation, "up"))  # type: ignore[arg-type]
    return body


def test_openai_tool_fields_become_neutral_values() -> None:
    generation = openai_chat(
        tools=[OPENAI_TOOL],
        tool_choice={"type": "function", "function": {"name": "w"}},
        parallel_tool_calls=False,
        response_format={"type": "json_object"},
    )
    assert generation.tools == (Tool("w", "d", orjson.dumps(SCHEMA).decode()),)
    assert generation.tool_choice == ToolChoice(ToolChoiceMode.FUNCTION, "w")
    assert generation.parallel_tool_calls is False
    assert generation.response_format == ResponseFormat("json_object")


def test_openai_tool_fields_reach_the_upstream_unchanged() -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Let me check again.", "tool_calls": [CALL]},
    ]
    fields = {
        "messages": history,
        "tools": [OPENAI_TOOL, {"type": "function", "function": {"name": "bare"}}],
        "tool_choice": "required",
        "parallel_tool_calls": True,
        "response_format": schema_format,
    }
    body = upstream(openai_chat(**fields))
    for name, value in fields.items():
        assert body[name] == value, name


def test_anthropic_tools_and_blocks_reach_an_openai_upstream_in_its_shape() -> None:
    payload = {
        "model": "m",
        "max_tokens": 10,
        "system": "be brief",
        "tools": [{"name": "w", "description": "d", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}},
                    {"type": "tool_use", "id": "t2", "name": "w", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "content": [{"type": "text", "text": "rain"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ],
    }
    generation = parse_anthropic_messages(payload, SETTINGS).generation
    assert generation.messages == (
        ChatMessage("system", "be brief"),
        ChatMessage("user", "weather?"),
        ChatMessage(
            "assistant",
            "Checking.",
            (ToolCall("t1", "w", '{"city":"Oslo"}'), ToolCall("t2", "w", "{}")),
        ),
        ChatMessage("tool", "sunny", tool_call_id="t1"),
        ChatMessage("tool", "rain", tool_call_id="t2"),
        ChatMessage("user", "and tomorrow?"),
    )
    body = upstream(generation)
    assert body["tools"] == [
        {"type": "function", "function": {"name": "w", "description": "d", "parameters": SCHEMA}}
    ]
    assert body["tool_choice"] == "required"
    assert body["parallel_tool_calls"] is False
    assert body["messages"][2]["tool_calls"][0] == {
        "id": "t1",
        "type": "function",
        "function": {"name": "w", "arguments": '{"city":"Oslo"}'},
    }
    assert body["messages"][3] == {"role": "tool", "content": "sunny", "tool_call_id": "t1"}


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, ("auto", None)),
        ({"type": "none"}, ("none", None)),
        ({"type": "tool", "name": "w"}, ({"type": "function", "function": {"name": "w"}}, None)),
    ],
)
def test_anthropic_tool_choices_map_to_openai(
    choice: dict[str, object], expected: tuple[object, object]
) -> None:
    payload = {
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "x"}],
        "tool_choice": choice,
    }
    body = upstream(parse_anthropic_messages(payload, SETTINGS).generation)
    assert (body["tool_choice"], body.get("parallel_tool_calls")) == expected


def test_a_request_without_tools_sends_no_tool_fields() -> None:
    body = upstream(openai_chat())
    assert set(body) == {"model", "stream", "stream_options", "messages"}
    assert body["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [OPENAI_TOOL] * (MAX_TOOLS + 1)}, "tools"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
            "messages.0.tool_calls",
        ),
    ],
)
def test_bad_openai_tool_fields_are_refused_naming_them(
    fields: dict[str, object], param: str
) -> None:
    with pytest.raises(InvalidParameterError) as raised:
        openai_chat(**fields)
    assert raised.value.param is not None
    assert raised.value.param.startswith(param)
    assert str(raised.value).startswith(param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"name": "web", "type": "web_search_20250305"}]}, "tools.0"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "w", "input": {}}],
                    }
                ]
            },
            "messages.0.content.0",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
                ]
            },
            "messages.0.content.0",
        ),
    ],
)
def test_bad_anthropic_tool_fields_are_refused_naming_them(
    fields: dict[str, object], param: str
) -> None:
    payload = {
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "x"}],
        **fields,
    }
    with pytest.raises(InvalidParameterError) as raised:
        parse_anthropic_messages(payload, SETTINGS)
    assert raised.value.param is not None
    assert raised.value.param.startswith(param)


def test_a_schema_nested_deeper_than_json_can_be_written_is_refused_naming_it() -> None:
    deep: dict[str, Any] = {}
    for _ in range(300):
        deep = {"items": deep}
    tool = {"type": "function", "function": {"name": "w", "parameters": deep}}
    with pytest.raises(InvalidParameterError) as raised:
        openai_chat(tools=[tool])
    assert raised.value.param == "tools.0.function.parameters"
