"""OpenAI dialect: golden chunk sequences and whole responses, checked against the SDK too.

Where the ``openai`` SDK is installed, every chunk is parsed with its own
``ChatCompletionChunk``/``Completion`` models and the stream is replayed through its
``ChatCompletionStreamState``: a reference we did not write.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import orjson
import pytest

from sluice.dialects.openai import (
    DONE,
    Accumulator,
    ChunkRenderer,
    CompletionKind,
    error_body,
    error_type_for_status,
)
from sluice.errors import ProtocolError
from sluice.events import (
    Error,
    Finished,
    FinishReason,
    NeutralEvent,
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

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700, "model": "m"}
TEXT_HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 1700, "model": "m"}


def renderer(kind: CompletionKind = "chat", *, include_usage: bool = False) -> ChunkRenderer:
    completion_id = "chatcmpl-1" if kind == "chat" else "cmpl-1"
    return ChunkRenderer(
        kind=kind,
        completion_id=completion_id,
        model="m",
        created=1700,
        include_usage=include_usage,
    )


def accumulate(events: Sequence[NeutralEvent], kind: CompletionKind = "chat") -> Accumulator:
    completion_id = "chatcmpl-1" if kind == "chat" else "cmpl-1"
    acc = Accumulator(kind=kind, completion_id=completion_id, model="m", created=1700)
    return feed_all(acc, events)


def render(events: Sequence[NeutralEvent], r: ChunkRenderer | None = None) -> list[str]:
    """The data of every frame; asserts OpenAI never names an event."""
    r = r or renderer()
    frames = [frame for event in events for frame in r.render(event)]
    assert all(name is None for name, _ in frames)
    return [data for _, data in frames]


def parsed(data: Sequence[str]) -> list[object]:
    return [d if d == DONE else orjson.loads(d) for d in data]


def chunk(delta: dict[str, object], finish_reason: str | None = None) -> dict[str, object]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {**HEAD, "choices": [choice]}


def with_usage_null(chunks: list[dict[str, object]]) -> list[dict[str, object]]:
    return [{**c, "usage": None} for c in chunks]


ROLE = {"role": "assistant", "content": ""}


def tool_start(index: int, id: str, name: str, arguments: str) -> dict[str, object]:
    call = {
        "index": index,
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    return {"tool_calls": [call]}


def tool_more(index: int, arguments: str) -> dict[str, object]:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


# --- streamed chat ------------------------------------------------------------------------


def test_chat_text_stream_is_byte_exact() -> None:
    data = render([*HELLO, Finished(FinishReason.STOP)])
    head = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700,"model":"m",'
    tail = ',"logprobs":null,"finish_reason":null}]}'
    assert data == [
        head + '"choices":[{"index":0,"delta":{"role":"assistant","content":""}' + tail,
        head + '"choices":[{"index":0,"delta":{"content":"Hel"}' + tail,
        head + '"choices":[{"index":0,"delta":{"content":"lo"}' + tail,
        head + '"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}',
        "[DONE]",
    ]


def test_chat_text_delta_fast_path_equals_dumping_the_dict() -> None:
    text = 'quote " backslash \\ newline \n unicode é 😀 <script>'
    for include_usage in (False, True):
        (data,) = render([TextDelta(text)], renderer(include_usage=include_usage))
        expected = chunk({"content": text})
        if include_usage:
            expected["usage"] = None
        assert data == orjson.dumps(expected).decode()


def test_chat_include_usage_adds_null_usage_then_a_usage_chunk() -> None:
    data = render([*HELLO, Finished(FinishReason.STOP)], renderer(include_usage=True))
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert parsed(data) == [
        *with_usage_null(
            [
                chunk(ROLE),
                chunk({"content": "Hel"}),
                chunk({"content": "lo"}),
                chunk({}, "stop"),
            ]
        ),
        {**HEAD, "choices": [], "usage": usage},
        DONE,
    ]


def test_chat_usage_reports_cached_tokens_and_the_last_usage_wins() -> None:
    events = [
        Started("m", 1),
        Usage(9, 1),
        Usage(10, 3, cached_tokens=4),
        Finished(FinishReason.STOP),
    ]
    data = parsed(render(events, renderer(include_usage=True)))
    assert data[-2] == {
        **HEAD,
        "choices": [],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }


def test_chat_include_usage_without_a_usage_event_reports_zeros() -> None:
    data = parsed(
        render([Started("m", 1), Finished(FinishReason.STOP)], renderer(include_usage=True))
    )
    zeros = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    assert data[-2] == {**HEAD, "choices": [], "usage": zeros}


@pytest.mark.parametrize(
    ("reason", "wire"),
    [
        (FinishReason.STOP, "stop"),
        (FinishReason.LENGTH, "length"),
        (FinishReason.TOOL_CALLS, "tool_calls"),
    ],
)
def test_chat_finish_reason_maps_to_openai(reason: FinishReason, wire: str) -> None:
    data = parsed(render([Started("m", 1), TextDelta("x"), Finished(reason)]))
    assert data[-2:] == [chunk({}, wire), DONE]


def test_a_matched_stop_sequence_is_still_finish_reason_stop() -> None:
    events = [Started("m", 1), TextDelta("x"), Finished(FinishReason.STOP, stop_sequence=".")]
    assert parsed(render(events))[-2:] == [chunk({}, "stop"), DONE]


def test_chat_tool_call_whole_in_one_delta() -> None:
    events = [Started("m", 1), ToolCallDelta(0, WEATHER, id="call_1", name="weather")]
    data = parsed(render([*events, Finished(FinishReason.TOOL_CALLS)]))
    assert data == [
        chunk(ROLE),
        chunk(tool_start(0, "call_1", "weather", WEATHER)),
        chunk({}, "tool_calls"),
        DONE,
    ]


def test_chat_tool_call_one_character_per_delta_concatenates() -> None:
    events: list[NeutralEvent] = [Started("m", 1), ToolCallDelta(0, "", id="call_1", name="w")]
    events += [ToolCallDelta(0, c) for c in WEATHER]
    data = parsed(render([*events, Finished(FinishReason.TOOL_CALLS)]))
    assert data == [
        chunk(ROLE),
        chunk(tool_start(0, "call_1", "w", "")),
        *[chunk(tool_more(0, c)) for c in WEATHER],
        chunk({}, "tool_calls"),
        DONE,
    ]


def test_chat_parallel_tool_calls_keep_their_indexes() -> None:
    events = [
        Started("m", 1),
        ToolCallDelta(0, '{"city":', id="call_a", name="weather"),
        ToolCallDelta(1, '{"tz":', id="call_b", name="time"),
        ToolCallDelta(0, '"Oslo"}'),
        ToolCallDelta(1, '"CET"}'),
        Finished(FinishReason.TOOL_CALLS),
    ]
    assert parsed(render(events)) == [
        chunk(ROLE),
        chunk(tool_start(0, "call_a", "weather", '{"city":')),
        chunk(tool_start(1, "call_b", "time", '{"tz":')),
        chunk(tool_more(0, '"Oslo"}')),
        chunk(tool_more(1, '"CET"}')),
        chunk({}, "tool_calls"),
        DONE,
    ]


def test_chat_tool_call_repeating_id_and_name_is_a_continuation() -> None:
    events = [ToolCallDelta(0, "{", id="c", name="f"), ToolCallDelta(0, "}", id="c", name="f")]
    assert parsed(render(events)) == [chunk(tool_start(0, "c", "f", "{")), chunk(tool_more(0, "}"))]


def test_chat_tool_call_first_fragment_without_id_raises() -> None:
    with pytest.raises(ProtocolError, match="tool call 3"):
        renderer().render(ToolCallDelta(3, "{}"))


def test_chat_cancelled_renders_one_error_and_no_done() -> None:
    data = parsed(render([*HELLO, Finished(FinishReason.CANCELLED)]))
    assert data[-1] == {
        "error": {
            "message": "the stream was cancelled",
            "type": "server_error",
            "param": None,
            "code": "cancelled",
        }
    }
    assert DONE not in data
    assert len(data) == 4  # role, two deltas, the error


@pytest.mark.parametrize(
    ("error", "type_"),
    [
        (Error("backend_error", "upstream reset"), "server_error"),
        (Error("overloaded", "no room", retryable=True), "server_error"),
        (Error("invalid_request", "prompt too long"), "invalid_request_error"),
    ],
)
def test_chat_error_renders_one_error_and_no_done(error: Error, type_: str) -> None:
    data = parsed(render([*HELLO, error], renderer(include_usage=True)))
    assert data[-1] == {
        "error": {"message": error.message, "type": type_, "param": None, "code": error.type}
    }
    assert DONE not in data
    assert not any(isinstance(d, dict) and d.get("choices") == [] for d in data)


@pytest.mark.parametrize("terminal", [Finished(FinishReason.STOP), Error("backend_error", "x")])
def test_nothing_renders_after_the_terminal_event(terminal: NeutralEvent) -> None:
    assert_renders_nothing_after(renderer().render, terminal)


# --- streamed text completions ------------------------------------------------------------


def text_chunk(text: str, finish_reason: str | None = None) -> dict[str, object]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**TEXT_HEAD, "choices": [choice]}


def test_text_completion_stream() -> None:
    data = render([*HELLO, Finished(FinishReason.LENGTH)], renderer("text"))
    assert parsed(data) == [text_chunk("Hel"), text_chunk("lo"), text_chunk("", "length"), DONE]


def test_text_completion_stream_with_usage() -> None:
    data = render([*HELLO, Finished(FinishReason.STOP)], renderer("text", include_usage=True))
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert parsed(data) == [
        {**text_chunk("Hel"), "usage": None},
        {**text_chunk("lo"), "usage": None},
        {**text_chunk("", "stop"), "usage": None},
        {**TEXT_HEAD, "choices": [], "usage": usage},
        DONE,
    ]


def test_text_completion_ignores_tool_calls_and_reports_stop() -> None:
    events = [
        TextDelta("a"),
        ToolCallDelta(0, "{}", id="c", name="f"),
        Finished(FinishReason.TOOL_CALLS),
    ]
    assert parsed(render(events, renderer("text"))) == [
        text_chunk("a"),
        text_chunk("", "stop"),
        DONE,
    ]


def test_text_completion_error_has_no_done() -> None:
    data = parsed(render([TextDelta("a"), Error("backend_error", "boom")], renderer("text")))
    assert data == [text_chunk("a"), error_body("boom", type="server_error", code="backend_error")]


# --- whole responses ----------------------------------------------------------------------


def test_accumulator_chat_text() -> None:
    acc = accumulate([*HELLO, Finished(FinishReason.STOP)])
    assert acc.error() is None
    assert acc.result() == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


def test_accumulator_chat_assembles_parallel_and_character_tool_calls() -> None:
    events: list[NeutralEvent] = [Started("m", 1)]
    events.append(ToolCallDelta(1, "", id="call_b", name="time"))
    events.append(ToolCallDelta(0, "", id="call_a", name="weather"))
    events += [ToolCallDelta(0, c) for c in WEATHER]
    events += [
        ToolCallDelta(1, "{}"),
        Usage(4, 9, cached_tokens=2),
        Finished(FinishReason.TOOL_CALLS),
    ]
    result = accumulate(events).result()
    assert result["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "weather", "arguments": WEATHER},
                    },
                    {
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "time", "arguments": "{}"},
                    },
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ]
    assert result["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 9,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_accumulator_empty_answer_has_empty_string_content() -> None:
    message = accumulate([Started("m", 1), Finished(FinishReason.LENGTH)]).result()["choices"]
    assert message == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]


def test_accumulator_text_completion() -> None:
    result = accumulate([*HELLO, Finished(FinishReason.LENGTH)], "text").result()
    assert result == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700,
        "model": "m",
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


@pytest.mark.parametrize(
    ("terminal", "status", "body"),
    [
        (
            Finished(FinishReason.CANCELLED),
            503,
            error_body("the stream was cancelled", type="server_error", code="cancelled"),
        ),
        (
            Error("backend_error", "upstream reset"),
            502,
            error_body("upstream reset", type="server_error", code="backend_error"),
        ),
        (
            Error("backend_error", "busy", retryable=True),
            503,
            error_body("busy", type="server_error", code="backend_error"),
        ),
        (
            Error("overloaded", "full", retryable=True),
            503,
            error_body("full", type="server_error", code="overloaded"),
        ),
        (
            Error("invalid_request", "bad"),
            400,
            error_body("bad", type="invalid_request_error", code="invalid_request"),
        ),
        (
            Error("internal_error", "oops"),
            500,
            error_body("oops", type="server_error", code="internal_error"),
        ),
    ],
)
def test_accumulator_failed_stream_gives_status_and_body(
    terminal: NeutralEvent, status: int, body: dict[str, object]
) -> None:
    assert_failed_with(accumulate([*HELLO, terminal]), status, body)


def test_accumulator_result_before_the_end_raises() -> None:
    assert_unfinished(accumulate(HELLO))


def test_accumulator_refuses_events_after_the_terminal_one() -> None:
    assert_refuses_after_terminal(accumulate([Finished(FinishReason.STOP)]))


# --- error bodies -------------------------------------------------------------------------


def test_error_body_is_the_openai_envelope() -> None:
    body = error_body("no such model", type="invalid_request_error", code="model_not_found")
    assert orjson.dumps(body) == (
        b'{"error":{"message":"no such model","type":"invalid_request_error",'
        b'"param":null,"code":"model_not_found"}}'
    )
    assert error_body("x", type="t", code=None, param="model") == {
        "error": {"message": "x", "type": "t", "param": "model", "code": None}
    }


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "invalid_request_error"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (502, "server_error"),
        (503, "server_error"),
    ],
)
def test_error_type_for_status(status: int, type_: str) -> None:
    assert error_type_for_status(status) == type_


# --- against the official SDK -------------------------------------------------------------

SDK_CASES: dict[str, list[NeutralEvent]] = {
    "text": [*HELLO, Finished(FinishReason.STOP)],
    "length": [*HELLO, Finished(FinishReason.LENGTH)],
    "tool_whole": [
        Started("m", 1),
        TextDelta("Let me check."),
        ToolCallDelta(0, WEATHER, id="call_1", name="weather"),
        Usage(3, 7),
        Finished(FinishReason.TOOL_CALLS),
    ],
    "tool_chars": [
        Started("m", 1),
        ToolCallDelta(0, "", id="call_1", name="weather"),
        *[ToolCallDelta(0, c) for c in WEATHER],
        Finished(FinishReason.TOOL_CALLS),
    ],
    "parallel_and_zero_args": [
        Started("m", 1),
        ToolCallDelta(0, '{"city":"Oslo"}', id="call_a", name="weather"),
        ToolCallDelta(1, "{}", id="call_b", name="now"),
        ToolCallDelta(2, "", id="call_c", name="ping"),
        Usage(8, 20, cached_tokens=4),
        Finished(FinishReason.TOOL_CALLS),
    ],
}


@pytest.mark.parametrize("case", sorted(SDK_CASES))
@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_chunks_replay_through_the_sdk_to_the_accumulator_result(
    case: str, include_usage: bool
) -> None:
    sdk_chat = importlib.import_module("openai.types.chat")
    sdk_stream = importlib.import_module("openai.lib.streaming.chat")
    events = SDK_CASES[case]
    data = render(events, renderer(include_usage=include_usage))
    assert data[-1] == DONE
    state = sdk_stream.ChatCompletionStreamState()
    for d in data[:-1]:
        state.handle_chunk(sdk_chat.ChatCompletionChunk.model_validate_json(d))
    # The snapshot, not get_final_completion(): that one raises for finish_reason "length".
    final = state.current_completion_snapshot

    expected = accumulate(events).result()
    sdk_expected = sdk_chat.ChatCompletion.model_validate(expected)
    (choice,) = final.choices
    (expected_choice,) = sdk_expected.choices
    assert choice.finish_reason == expected_choice.finish_reason
    # The role chunk says content "" before anyone knows whether tool calls follow, so the
    # SDK's snapshot of a tool-calls-only stream has "" where a whole response has null.
    assert (choice.message.content or None) == (expected_choice.message.content or None)
    assert [
        (call.id, call.function.name, call.function.arguments)
        for call in choice.message.tool_calls or []
    ] == [
        (call.id, call.function.name, call.function.arguments)
        for call in expected_choice.message.tool_calls or []
    ]
    if include_usage:
        assert final.usage == sdk_expected.usage
    else:
        assert final.usage is None


def test_text_chunks_and_whole_completion_parse_as_sdk_models() -> None:
    sdk_types = importlib.import_module("openai.types")
    events = [*HELLO, Finished(FinishReason.STOP)]
    data = render(events, renderer("text", include_usage=True))
    # The SDK builds stream items without validation (its Completion model says a
    # finish_reason is never null, which holds only for the last chunks), so validate those.
    payloads = [orjson.loads(d) for d in data[:-1]]
    assert "".join(p["choices"][0]["text"] for p in payloads if p["choices"]) == "Hello"
    last, usage = (sdk_types.Completion.model_validate(p) for p in payloads[-2:])
    assert last.choices[0].finish_reason == "stop"
    assert usage.usage is not None
    assert usage.usage.total_tokens == 7
    whole = sdk_types.Completion.model_validate(accumulate(events, "text").result())
    assert whole.choices[0].text == "Hello"
    assert whole.choices[0].finish_reason == "stop"


def test_in_band_error_is_what_the_sdk_raises_on() -> None:
    """The SDK raises ``APIError`` for a ``data:`` whose JSON has an ``error`` member."""
    sdk = importlib.import_module("openai")
    (data,) = render([Error("backend_error", "upstream reset")])
    body = orjson.loads(data)
    assert body["error"]["message"] == "upstream reset"
    assert sdk.types.ErrorObject.model_validate(body["error"]).code == "backend_error"
