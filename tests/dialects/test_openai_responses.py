"""OpenAI Responses dialect: event sequences and whole responses, checked against the SDK.

Every event is validated strictly by the ``openai`` SDK's own pydantic models
(``ResponseStreamEvent``, ``Response``) and every stream is replayed through the SDK's
``ResponseStreamState`` (what ``client.responses.stream()`` runs), which raises on an
event out of order: references we did not write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import pydantic
import pytest
from openai import omit
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from sluice.dialects.base import Message, RequestLimits
from sluice.dialects.openai_responses import DIALECT, ResponseAccumulator, ResponseRenderer
from sluice.errors import InvalidParameterError, ProtocolError
from sluice.events import (
    Error,
    Finished,
    FinishReason,
    NeutralEvent,
    RenderMeta,
    Started,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from tests.dialects.helpers import (
    HELLO,
    WEATHER,
    assert_failed_with,
    assert_refuses_after_terminal,
    assert_renders_nothing_after,
    assert_unfinished,
    feed_all,
)

STREAM_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
CALL = [ToolCallDelta(0, WEATHER[:9], "call_1", "get_weather"), ToolCallDelta(0, WEATHER[9:])]
OPENING = ["response.created", "response.in_progress"]
MESSAGE_OPENS = ["response.output_item.added", "response.content_part.added"]
MESSAGE_CLOSES = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
CALL_CLOSES = ["response.function_call_arguments.done", "response.output_item.done"]


def meta(payload: dict[str, Any] | None = None) -> RenderMeta:
    options = () if payload is None else DIALECT.parse(payload, RequestLimits()).options
    return RenderMeta("openai_responses", "resp_1", "m", 1700, False, True, options)


def render(events: Sequence[NeutralEvent], r: ResponseRenderer | None = None) -> list[Message]:
    r = r or ResponseRenderer(meta())
    return [message for event in events for message in r.render(event)]


def checked(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The data of every message, each validated by the SDK's models and replayed through
    its stream state; asserts names repeat ``type`` and sequence numbers count from 0."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    payloads = []
    for number, (name, data) in enumerate(messages):
        payload = orjson.loads(data)
        assert payload["type"] == name
        assert payload["sequence_number"] == number
        STREAM_EVENTS.validate_python(payload)
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=payload))  # type: ignore[arg-type]
        payloads.append(payload)
    return payloads


def names(messages: Sequence[Message]) -> list[str | None]:
    return [name for name, _ in messages]


def test_a_text_stream_opens_one_message_and_completes_with_usage() -> None:
    messages = render([*HELLO, Finished(FinishReason.STOP)])
    assert names(messages) == [
        *OPENING,
        *MESSAGE_OPENS,
        "response.output_text.delta",
        "response.output_text.delta",
        *MESSAGE_CLOSES,
        "response.completed",
    ]
    payloads = checked(messages)
    assert [p["delta"] for p in payloads if p["type"] == "response.output_text.delta"] == [
        "Hel",
        "lo",
    ]
    assert payloads[0]["response"]["status"] == "in_progress"
    completed = Response.model_validate(payloads[-1]["response"])
    assert completed.status == "completed"
    assert completed.output_text == "Hello"
    assert completed.output[0].id == "msg_1_0"
    assert completed.usage is not None
    assert (completed.usage.input_tokens, completed.usage.output_tokens) == (5, 2)
    assert completed.usage.total_tokens == 7


def test_the_text_delta_fast_path_equals_the_whole_event() -> None:
    messages = render([Started("m", 1700), TextDelta('a "quoted"\nline ✓')])
    delta = orjson.loads(messages[-1][1])
    assert delta == {
        "type": "response.output_text.delta",
        "item_id": "msg_1_0",
        "output_index": 0,
        "content_index": 0,
        "delta": 'a "quoted"\nline ✓',
        "logprobs": [],
        "sequence_number": 4,
    }


def test_a_length_cut_closes_the_item_incomplete_and_ends_incomplete() -> None:
    payloads = checked(render([*HELLO, Finished(FinishReason.LENGTH)]))
    assert payloads[-2]["item"]["status"] == "incomplete"
    response = Response.model_validate(payloads[-1]["response"])
    assert payloads[-1]["type"] == "response.incomplete"
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "Hello"


def test_tool_calls_are_function_call_items_between_messages() -> None:
    events = [Started("m", 1700, 5), TextDelta("Let me see."), *CALL, TextDelta("Done.")]
    messages = render([*events, Usage(5, 9), Finished(FinishReason.TOOL_CALLS)])
    assert names(messages) == [
        *OPENING,
        *MESSAGE_OPENS,
        "response.output_text.delta",
        *MESSAGE_CLOSES,
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        *CALL_CLOSES,
        *MESSAGE_OPENS,
        "response.output_text.delta",
        *MESSAGE_CLOSES,
        "response.completed",
    ]
    payloads = checked(messages)
    response = Response.model_validate(payloads[-1]["response"])
    assert [item.type for item in response.output] == ["message", "function_call", "message"]
    call = response.output[1]
    assert call.type == "function_call"
    assert (call.id, call.call_id, call.name, call.arguments) == (
        "fc_1_1",
        "call_1",
        "get_weather",
        WEATHER,
    )
    assert [p["output_index"] for p in payloads if p["type"].endswith(".delta")] == [0, 1, 1, 2]


def test_a_fragment_of_a_closed_call_and_a_first_fragment_without_a_name_raise() -> None:
    r = ResponseRenderer(meta())
    render([Started("m", 1700), *CALL, TextDelta("x")], r)
    with pytest.raises(ProtocolError, match="after its item fc_1_0 was closed"):
        r.render(ToolCallDelta(0, "}"))
    with pytest.raises(ProtocolError, match="carries no id or name"):
        ResponseRenderer(meta()).render(ToolCallDelta(0, "{}"))


@pytest.mark.parametrize(
    ("terminal", "code", "status", "response_code"),
    [
        (Finished(FinishReason.CANCELLED), "cancelled", "cancelled", "server_error"),
        (Error("backend_error", "it broke"), "backend_error", "failed", "server_error"),
        (Error("invalid_request", "bad tools"), "invalid_request", "failed", "invalid_prompt"),
        (Error("overloaded", "busy", retryable=True), "overloaded", "failed", "server_error"),
    ],
)
def test_a_bad_end_sends_error_then_response_failed_with_the_output_so_far(
    terminal: NeutralEvent, code: str, status: str, response_code: str
) -> None:
    messages = render([*HELLO, terminal])
    assert names(messages)[-2:] == ["error", "response.failed"]
    payloads = checked(messages)
    error = payloads[-2]
    assert (error["code"], error["param"]) == (code, None)
    failed = Response.model_validate(payloads[-1]["response"])
    assert failed.status == status
    assert failed.error is not None
    assert (failed.error.code, failed.error.type) == (response_code, code)
    assert failed.error.message == error["message"]
    assert failed.output_text == "Hello"
    assert failed.output[0].status == "incomplete"
    assert failed.usage is not None


@pytest.mark.parametrize(
    "terminal",
    [
        Finished(FinishReason.STOP),
        Finished(FinishReason.LENGTH),
        Finished(FinishReason.TOOL_CALLS),
        Finished(FinishReason.CANCELLED),
        Error("backend_error", "it broke"),
    ],
)
def test_nothing_renders_after_any_terminal_event(terminal: NeutralEvent) -> None:
    r = ResponseRenderer(meta())
    render(HELLO, r)
    assert_renders_nothing_after(r.render, terminal)


def test_usage_counts_cached_tokens_and_defaults_to_the_prompt_at_admission() -> None:
    cached = checked(render([*HELLO[:-1], Usage(5, 2, 3), Finished(FinishReason.STOP)]))
    usage = cached[-1]["response"]["usage"]
    assert usage["input_tokens"] == 5
    assert usage["input_tokens_details"] == {"cached_tokens": 3, "cache_write_tokens": 0}
    plain = checked(render([Started("m", 1700, 4), TextDelta("x"), Finished(FinishReason.STOP)]))
    assert plain[-1]["response"]["usage"]["input_tokens"] == 4
    assert plain[-1]["response"]["usage"]["output_tokens"] == 0


def test_the_response_echoes_the_request() -> None:
    request = {
        "input": "hi",
        "instructions": "Be brief.",
        "temperature": 0.5,
        "top_p": 0.9,
        "max_output_tokens": 32,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    }
    created = checked(render(HELLO, ResponseRenderer(meta(request))))[0]["response"]
    response = Response.model_validate(created)
    assert response.instructions == "Be brief."
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.5, 0.9, 32)
    assert response.parallel_tool_calls is False
    assert [tool.type for tool in response.tools] == ["function"]
    assert created["tool_choice"] == {"type": "function", "name": "f"}
    assert created["text"]["format"]["schema"] == {"type": "object"}


def test_a_resumed_reader_renders_the_same_messages() -> None:
    events = [*HELLO, *CALL, Finished(FinishReason.TOOL_CALLS)]
    assert render(events) == render(events)


# -- whole responses -----------------------------------------------------------------------


def whole(events: Sequence[NeutralEvent]) -> ResponseAccumulator:
    return feed_all(ResponseAccumulator(meta()), events)


def test_a_whole_response_equals_the_streamed_one() -> None:
    events = [*HELLO, *CALL, TextDelta("!"), Finished(FinishReason.TOOL_CALLS)]
    streamed = orjson.loads(render(events)[-1][1])["response"]
    result = whole(events).result()
    assert result == streamed
    assert Response.model_validate(result).output_text == "Hello!"


def test_a_whole_length_cut_is_an_incomplete_response() -> None:
    result = Response.model_validate(whole([*HELLO, Finished(FinishReason.LENGTH)]).result())
    assert result.status == "incomplete"
    assert result.output[-1].status == "incomplete"


@pytest.mark.parametrize(
    ("terminal", "status", "code"),
    [
        (Finished(FinishReason.CANCELLED), 503, "cancelled"),
        (Error("backend_error", "it broke"), 502, "backend_error"),
        (Error("invalid_request", "bad"), 400, "invalid_request"),
    ],
)
def test_a_whole_response_that_failed_has_the_shared_status_and_an_openai_body(
    terminal: NeutralEvent, status: int, code: str
) -> None:
    acc = whole([*HELLO, terminal])
    message = "the stream was cancelled" if code == "cancelled" else terminal.message  # type: ignore[union-attr]
    error_type = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    assert_failed_with(acc, status, body)
    assert_refuses_after_terminal(acc)


def test_an_unfinished_whole_response_has_no_result() -> None:
    assert_unfinished(whole(HELLO))


# -- requests ------------------------------------------------------------------------------


def parse(**fields: Any) -> Any:
    return DIALECT.parse({"input": "hi", **fields}, RequestLimits(max_prompt_chars=100))


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    parsed = parse(instructions="Be brief.", max_output_tokens=8, temperature=0, stream=True)
    assert parsed.model == "words"
    assert parsed.stream
    assert [(m.role, m.content) for m in parsed.generation.messages] == [
        ("system", "Be brief."),
        ("user", "hi"),
    ]
    assert (parsed.generation.max_tokens, parsed.generation.temperature) == (8, 0)


def test_input_items_become_a_chat_history_with_tool_calls_and_results() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "two"}],
        },
    ]
    messages = parse(input=items).generation.messages
    assert [(m.role, m.content, m.tool_call_id) for m in messages] == [
        ("system", "Use tools.", None),
        ("user", "Q?", None),
        ("assistant", "Let me see.", None),
        ("tool", "one", "c1"),
        ("tool", "two", "c2"),
    ]
    assert [call.id for call in messages[2].tool_calls] == ["c1", "c2"]


def test_function_tools_and_a_json_schema_format_map_onto_the_chat_fields() -> None:
    generation = parse(
        tools=[
            {
                "type": "function",
                "name": "f",
                "description": "d",
                "parameters": {"a": 1},
                "strict": True,
            }
        ],
        tool_choice="required",
        parallel_tool_calls=False,
        text={
            "format": {
                "type": "json_schema",
                "name": "x",
                "schema": {"type": "object"},
                "strict": True,
            }
        },
    ).generation
    [tool] = generation.tools
    assert (tool.name, tool.description, tool.parameters, tool.strict) == (
        "f",
        "d",
        '{"a":1}',
        True,
    )
    assert generation.tool_choice is not None
    assert generation.tool_choice.mode == "required"
    assert generation.parallel_tool_calls is False
    assert generation.response_format is not None
    assert orjson.loads(generation.response_format.json_schema or "") == {
        "name": "x",
        "schema": {"type": "object"},
        "strict": True,
    }


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"input": [{"content": "no role"}]}, "input.0.role"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"conversation": "conv_x"}, "conversation"),
        ({"background": True}, "background"),
        ({"temperature": 5}, "temperature"),
        ({"max_output_tokens": 10**7}, "max_output_tokens"),
        ({"input": "x" * 101}, "input"),
        ({"input": []}, "input"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        parse(**fields)
    assert refused.value.param == param
    assert str(refused.value).startswith(param)


def test_fields_that_change_nothing_are_ignored() -> None:
    parsed = parse(store=True, metadata={"a": "b"}, user="u", reasoning={"effort": "low"})
    assert [m.content for m in parsed.generation.messages] == ["hi"]


def test_the_dialect_names_its_endpoint_and_openai_error_bodies() -> None:
    assert (DIALECT.name, DIALECT.path, DIALECT.response_id_prefix) == (
        "openai_responses",
        "/v1/responses",
        "resp_",
    )
    assert not DIALECT.retry_hint
    assert DIALECT.error_body(400, "bad", param="input") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "input", "code": None}
    }
