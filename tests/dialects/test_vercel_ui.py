"""Vercel AI SDK UI message stream dialect: golden chunk sequences, whole messages, request
bodies. The chunks' schema is checked by the ``ai`` package itself, under Node, in
tests/gateway/test_vercel_ui.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from sluice.dialects.base import Message, RequestLimits
from sluice.dialects.vercel_ui import DIALECT, DONE, UIAccumulator, UIChunkRenderer
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

META = RenderMeta("vercel_ui", "uimsg_1", "m", 1700, resumable=False)
CALL = [ToolCallDelta(0, WEATHER[:9], "call_1", "get_weather"), ToolCallDelta(0, WEATHER[9:])]
USAGE = {"usage": {"inputTokens": 5, "outputTokens": 2, "totalTokens": 7}}


def render(events: Sequence[NeutralEvent], r: UIChunkRenderer | None = None) -> list[Any]:
    """Every chunk, parsed (``[DONE]`` as is); asserts no chunk is named."""
    r = r or UIChunkRenderer(META)
    messages: list[Message] = [m for event in events for m in r.render(event)]
    assert all(name is None for name, _ in messages)
    return [data if data == DONE else orjson.loads(data) for _, data in messages]


def test_a_text_stream_is_start_text_parts_finish_and_done() -> None:
    assert render([*HELLO, Finished(FinishReason.STOP)]) == [
        {"type": "start", "messageId": "uimsg_1"},
        {"type": "start-step"},
        {"type": "text-start", "id": "text-0"},
        {"type": "text-delta", "id": "text-0", "delta": "Hel"},
        {"type": "text-delta", "id": "text-0", "delta": "lo"},
        {"type": "text-end", "id": "text-0"},
        {"type": "finish-step"},
        {"type": "finish", "finishReason": "stop", "messageMetadata": USAGE},
        DONE,
    ]


def test_the_text_delta_fast_path_is_valid_json() -> None:
    [*_, delta] = render([Started("m", 1700), TextDelta('a "quoted"\nline ✓')])
    assert delta == {"type": "text-delta", "id": "text-0", "delta": 'a "quoted"\nline ✓'}


@pytest.mark.parametrize(
    ("reason", "finish_reason"),
    [(FinishReason.LENGTH, "length"), (FinishReason.TOOL_CALLS, "tool-calls")],
)
def test_finish_reasons_are_the_ai_sdks(reason: FinishReason, finish_reason: str) -> None:
    chunks = render([*HELLO, Finished(reason)])
    assert chunks[-2]["finishReason"] == finish_reason
    assert chunks[-1] == DONE


def test_a_tool_call_is_a_tool_input_part_between_text_parts() -> None:
    events = [Started("m", 1700), TextDelta("Let me see."), *CALL, TextDelta("Done.")]
    chunks = render([*events, Finished(FinishReason.TOOL_CALLS)])
    head = {"toolCallId": "call_1", "toolName": "get_weather"}
    assert chunks[2:10] == [
        {"type": "text-start", "id": "text-0"},
        {"type": "text-delta", "id": "text-0", "delta": "Let me see."},
        {"type": "text-end", "id": "text-0"},
        {"type": "tool-input-start", **head},
        {"type": "tool-input-delta", "toolCallId": "call_1", "inputTextDelta": WEATHER[:9]},
        {"type": "tool-input-delta", "toolCallId": "call_1", "inputTextDelta": WEATHER[9:]},
        {"type": "tool-input-available", **head, "input": {"city": "Paris", "unit": "c"}},
        {"type": "text-start", "id": "text-2"},
    ]


def test_a_call_cut_off_before_its_json_ends_is_a_tool_input_error() -> None:
    chunks = render([Started("m", 1700), CALL[0], Finished(FinishReason.LENGTH)])
    error = chunks[-4]
    assert error["type"] == "tool-input-error"
    assert error["input"] == WEATHER[:9]
    assert "not JSON" in error["errorText"]


def test_a_fragment_of_a_closed_call_and_a_first_fragment_without_a_name_raise() -> None:
    r = UIChunkRenderer(META)
    render([Started("m", 1700), *CALL, TextDelta("x")], r)
    with pytest.raises(ProtocolError, match="after its part was closed"):
        r.render(ToolCallDelta(0, "}"))
    with pytest.raises(ProtocolError, match="carries no id or name"):
        UIChunkRenderer(META).render(ToolCallDelta(0, "{}"))


@pytest.mark.parametrize(
    ("terminal", "text"),
    [
        (Finished(FinishReason.CANCELLED), "the stream was cancelled"),
        (Error("backend_error", "it broke"), "it broke"),
    ],
)
def test_a_bad_end_is_one_error_chunk_and_no_done(terminal: NeutralEvent, text: str) -> None:
    chunks = render([*HELLO, terminal])
    assert chunks[-1] == {"type": "error", "errorText": text}
    assert DONE not in chunks
    assert not any(chunk["type"] in ("finish", "text-end") for chunk in chunks)


@pytest.mark.parametrize(
    "terminal",
    [
        Finished(FinishReason.STOP),
        Finished(FinishReason.LENGTH),
        Finished(FinishReason.CANCELLED),
        Error("backend_error", "it broke"),
    ],
)
def test_nothing_renders_after_any_terminal_event(terminal: NeutralEvent) -> None:
    r = UIChunkRenderer(META)
    render(HELLO, r)
    assert_renders_nothing_after(r.render, terminal)


def test_usage_without_a_usage_event_is_zeros() -> None:
    chunks = render([Started("m", 1700), TextDelta("x"), Finished(FinishReason.STOP)])
    assert chunks[-2]["messageMetadata"]["usage"]["totalTokens"] == 0


# -- whole messages ------------------------------------------------------------------------


def test_a_whole_answer_is_the_assistants_ui_message() -> None:
    acc = feed_all(UIAccumulator(META), [*HELLO, *CALL, Finished(FinishReason.TOOL_CALLS)])
    assert acc.result() == {
        "id": "uimsg_1",
        "role": "assistant",
        "parts": [
            {"type": "text", "text": "Hello", "state": "done"},
            {
                "type": "tool-get_weather",
                "toolCallId": "call_1",
                "state": "input-available",
                "input": {"city": "Paris", "unit": "c"},
            },
        ],
        "metadata": {"finishReason": "tool-calls", **USAGE},
    }


def test_a_whole_answer_that_failed_has_the_shared_status_and_an_openai_body() -> None:
    acc = feed_all(UIAccumulator(META), [*HELLO, Error("backend_error", "it broke")])
    body = {
        "error": {
            "message": "it broke",
            "type": "server_error",
            "param": None,
            "code": "backend_error",
        }
    }
    assert_failed_with(acc, 502, body)
    assert_refuses_after_terminal(acc)
    assert_unfinished(feed_all(UIAccumulator(META), HELLO))


# -- requests ------------------------------------------------------------------------------


def ui_message(role: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"m-{role}", "role": role, "parts": list(parts)}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def parse(*messages: dict[str, Any], **fields: Any) -> Any:
    body = {"id": "chat-1", "messages": list(messages), "trigger": "submit-message", **fields}
    return DIALECT.parse(body, RequestLimits(max_prompt_chars=100))


def test_a_use_chat_body_is_a_streamed_chat_of_the_text_parts() -> None:
    parsed = parse(
        ui_message("user", text("Hi "), text("there")),
        ui_message(
            "assistant",
            {"type": "step-start"},
            {"type": "reasoning", "text": "hmm"},
            text("Hello."),
            {"type": "source-url", "sourceId": "s", "url": "https://example.com"},
            {"type": "data-weather", "data": {"a": 1}},
        ),
        ui_message("user", text("Again")),
        system="Be brief.",
        model="sluice-tiny",
        max_tokens=8,
        temperature=0,
    )
    assert parsed.stream
    assert parsed.model == "sluice-tiny"
    assert [(m.role, m.content) for m in parsed.generation.messages] == [
        ("system", "Be brief."),
        ("user", "Hi there"),
        ("assistant", "Hello."),
        ("user", "Again"),
    ]
    assert (parsed.generation.max_tokens, parsed.generation.temperature) == (8, 0)


def test_the_model_defaults_to_the_servers() -> None:
    assert parse(ui_message("user", text("x"))).model == "words"
    assert not parse(ui_message("user", text("x")), stream=False).stream


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "file", "mediaType": "image/png", "url": "data:,"}, "messages.0.parts.1.type"),
        (
            {"type": "tool-get_weather", "toolCallId": "c", "state": "input-available"},
            "messages.0.parts.1.type",
        ),
        ({"type": "dynamic-tool", "toolName": "f", "toolCallId": "c"}, "messages.0.parts.1.type"),
        ({"type": "text"}, "messages.0.parts.1.text"),
    ],
)
def test_parts_that_cannot_be_honoured_are_refused_naming_them(
    part: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        parse(ui_message("user", text("x"), part))
    assert refused.value.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "parts": []}]}, "messages.0.role"),
        ({"messages": [ui_message("user", text("x" * 101))]}, "messages"),
        ({"messages": [ui_message("user", text("x"))], "max_tokens": 10**7}, "max_tokens"),
        ({"messages": [ui_message("user", text("x"))], "temperature": 3}, "temperature"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        DIALECT.parse(fields, RequestLimits(max_prompt_chars=100))
    assert refused.value.param == param


def test_the_dialect_names_its_endpoint_and_protocol_header() -> None:
    assert (DIALECT.name, DIALECT.path) == ("vercel_ui", "/v1/ui/chat")
    assert DIALECT.headers(META) == {"x-vercel-ai-ui-message-stream": "v1"}
    assert not DIALECT.retry_hint
