"""Anthropic dialect: golden event sequences and whole messages, checked against the SDK too.

Where the ``anthropic`` SDK is installed, every rendered event is validated with its
``RawMessageStreamEvent`` union and fed to its own ``accumulate_event`` (what
``MessageStream.get_final_message()`` uses); the snapshot must equal our whole message.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import orjson
import pytest

from sluice.dialects.anthropic import (
    Accumulator,
    MessagesRenderer,
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


def renderer() -> MessagesRenderer:
    return MessagesRenderer(message_id="msg_1", model="m")


def render(events: Sequence[NeutralEvent], r: MessagesRenderer | None = None) -> list[str]:
    """``event: data`` lines; asserts the data's ``type`` always equals the event name."""
    r = r or renderer()
    frames = [frame for event in events for frame in r.render(event)]
    for name, data in frames:
        assert orjson.loads(data)["type"] == name
    return [f"{name}: {data}" for name, data in frames]


def pairs(events: Sequence[NeutralEvent], r: MessagesRenderer | None = None) -> list[object]:
    r = r or renderer()
    return [(name, orjson.loads(data)) for event in events for name, data in r.render(event)]


def accumulate(events: Sequence[NeutralEvent]) -> Accumulator:
    acc = Accumulator(message_id="msg_1", model="m")
    return feed_all(acc, events)


START = [
    (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "m",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 5, "output_tokens": 0},
            },
        },
    ),
    ("ping", {"type": "ping"}),
]


def block_start(index: int, block: dict[str, object]) -> tuple[str, object]:
    return "content_block_start", {
        "type": "content_block_start",
        "index": index,
        "content_block": block,
    }


def text_delta(index: int, text: str) -> tuple[str, object]:
    delta = {"type": "text_delta", "text": text}
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def json_delta(index: int, partial: str) -> tuple[str, object]:
    delta = {"type": "input_json_delta", "partial_json": partial}
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def block_stop(index: int) -> tuple[str, object]:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


def tool_use(id: str, name: str) -> dict[str, object]:
    return {"type": "tool_use", "id": id, "name": name, "input": {}}


def end(stop_reason: str, output_tokens: int, input_tokens: int = 5) -> list[tuple[str, object]]:
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens}
    delta = {"stop_reason": stop_reason, "stop_sequence": None}
    return [
        ("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}),
        ("message_stop", {"type": "message_stop"}),
    ]


TEXT_BLOCK = {"type": "text", "text": ""}

# --- streamed -----------------------------------------------------------------------------


def test_text_stream_is_byte_exact() -> None:
    assert render([*HELLO, Finished(FinishReason.STOP)]) == [
        'message_start: {"type":"message_start","message":{"id":"msg_1","type":"message",'
        '"role":"assistant","model":"m","content":[],"stop_reason":null,"stop_sequence":null,'
        '"usage":{"input_tokens":5,"output_tokens":0}}}',
        'ping: {"type":"ping"}',
        'content_block_start: {"type":"content_block_start","index":0,'
        '"content_block":{"type":"text","text":""}}',
        'content_block_delta: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"Hel"}}',
        'content_block_delta: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"lo"}}',
        'content_block_stop: {"type":"content_block_stop","index":0}',
        'message_delta: {"type":"message_delta","delta":{"stop_reason":"end_turn",'
        '"stop_sequence":null},"usage":{"input_tokens":5,"output_tokens":2}}',
        'message_stop: {"type":"message_stop"}',
    ]


def test_text_delta_fast_path_escapes_like_orjson() -> None:
    text = 'quote " backslash \\ newline \n unicode é 😀'
    frames = renderer().render(TextDelta(text))
    assert frames[-1] == (
        "content_block_delta",
        orjson.dumps(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": text},
            }
        ).decode(),
    )


@pytest.mark.parametrize(
    ("reason", "stop_reason"),
    [
        (FinishReason.STOP, "end_turn"),
        (FinishReason.LENGTH, "max_tokens"),
        (FinishReason.TOOL_CALLS, "tool_use"),
    ],
)
def test_finish_reason_maps_to_stop_reason(reason: FinishReason, stop_reason: str) -> None:
    assert pairs([*HELLO, Finished(reason)]) == [
        *START,
        block_start(0, TEXT_BLOCK),
        text_delta(0, "Hel"),
        text_delta(0, "lo"),
        block_stop(0),
        *end(stop_reason, 2),
    ]


def test_usage_moves_cached_tokens_to_cache_read_and_the_last_one_wins() -> None:
    events = [
        Started("m", 1, 5),
        Usage(9, 1),
        Usage(10, 3, cached_tokens=4),
        Finished(FinishReason.STOP),
    ]
    message_delta = pairs(events)[-2]
    assert message_delta == (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"input_tokens": 6, "cache_read_input_tokens": 4, "output_tokens": 3},
        },
    )


def test_empty_answer_has_no_blocks() -> None:
    assert pairs([Started("m", 1, 5), Finished(FinishReason.STOP)]) == [*START, *end("end_turn", 0)]


def test_tool_call_whole_in_one_delta_after_text() -> None:
    events = [
        Started("m", 1, 5),
        TextDelta("Checking."),
        ToolCallDelta(0, WEATHER, id="toolu_1", name="weather"),
        Usage(5, 12),
        Finished(FinishReason.TOOL_CALLS),
    ]
    assert pairs(events) == [
        *START,
        block_start(0, TEXT_BLOCK),
        text_delta(0, "Checking."),
        block_stop(0),
        block_start(1, tool_use("toolu_1", "weather")),
        json_delta(1, WEATHER),
        block_stop(1),
        *end("tool_use", 12),
    ]


def test_tool_call_one_character_per_delta() -> None:
    events: list[NeutralEvent] = [Started("m", 1, 5), ToolCallDelta(0, "", id="t", name="w")]
    events += [ToolCallDelta(0, c) for c in WEATHER]
    assert pairs([*events, Usage(5, 9), Finished(FinishReason.TOOL_CALLS)]) == [
        *START,
        block_start(0, tool_use("t", "w")),
        *[json_delta(0, c) for c in WEATHER],
        block_stop(0),
        *end("tool_use", 9),
    ]


def test_parallel_and_zero_argument_tool_calls_are_sequential_blocks() -> None:
    events = [
        Started("m", 1, 5),
        ToolCallDelta(0, '{"city":', id="t_a", name="weather"),
        ToolCallDelta(0, '"Oslo"}'),
        ToolCallDelta(1, "{}", id="t_b", name="now"),
        ToolCallDelta(2, "", id="t_c", name="ping"),
        ToolCallDelta(2, ""),
        Usage(5, 20),
        Finished(FinishReason.TOOL_CALLS),
    ]
    assert pairs(events) == [
        *START,
        block_start(0, tool_use("t_a", "weather")),
        json_delta(0, '{"city":'),
        json_delta(0, '"Oslo"}'),
        block_stop(0),
        block_start(1, tool_use("t_b", "now")),
        json_delta(1, "{}"),
        block_stop(1),
        block_start(2, tool_use("t_c", "ping")),
        block_stop(2),
        *end("tool_use", 20),
    ]


def test_text_after_a_tool_call_opens_a_new_text_block() -> None:
    events = [ToolCallDelta(0, "{}", id="t", name="f"), TextDelta("done")]
    assert pairs(events) == [
        block_start(0, tool_use("t", "f")),
        json_delta(0, "{}"),
        block_stop(0),
        block_start(1, TEXT_BLOCK),
        text_delta(1, "done"),
    ]


def test_fragment_for_a_stopped_tool_block_raises() -> None:
    r = renderer()
    r.render(ToolCallDelta(0, "{", id="t_a", name="f"))
    r.render(ToolCallDelta(1, "{", id="t_b", name="g"))
    with pytest.raises(ProtocolError, match="tool call 0 after its block 0 was stopped"):
        r.render(ToolCallDelta(0, "}"))


def test_first_tool_fragment_without_id_or_name_raises() -> None:
    with pytest.raises(ProtocolError, match="tool call 0"):
        renderer().render(ToolCallDelta(0, "{}", id="t"))


def test_cancelled_renders_one_error_and_no_message_stop() -> None:
    frames = pairs([*HELLO, Finished(FinishReason.CANCELLED)])
    assert frames[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "the stream was cancelled"}},
    )
    names = [name for name, _ in frames]
    assert names.count("error") == 1
    assert "message_stop" not in names
    assert "message_delta" not in names


@pytest.mark.parametrize(
    ("error", "type_"),
    [
        (Error("backend_error", "upstream reset"), "api_error"),
        (Error("internal_error", "oops"), "api_error"),
        (Error("backend_error", "busy", retryable=True), "overloaded_error"),
        (Error("overloaded", "full", retryable=True), "overloaded_error"),
        (Error("invalid_request", "prompt too long"), "invalid_request_error"),
    ],
)
def test_error_renders_one_error_and_no_message_stop(error: Error, type_: str) -> None:
    frames = pairs([*HELLO, error])
    assert frames[-1] == ("error", error_body(error.message, type=type_))
    assert [name for name, _ in frames].count("message_stop") == 0


@pytest.mark.parametrize("terminal", [Finished(FinishReason.STOP), Error("backend_error", "x")])
def test_nothing_renders_after_the_terminal_event(terminal: NeutralEvent) -> None:
    assert_renders_nothing_after(renderer().render, terminal)


def test_a_matched_stop_sequence_is_the_stop_reason_with_its_string() -> None:
    frames = pairs([*HELLO, Finished(FinishReason.STOP, stop_sequence="END")])
    assert frames[-2] == (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "stop_sequence", "stop_sequence": "END"},
            "usage": {"input_tokens": 5, "output_tokens": 2},
        },
    )


def test_message_start_counts_the_prompt_tokens_known_at_admission() -> None:
    frames = pairs([Started("m", 1, 42), Finished(FinishReason.STOP)])
    assert frames[0][1]["message"]["usage"] == {"input_tokens": 42, "output_tokens": 0}  # type: ignore[index]
    # No Usage event came: the end repeats what message_start said.
    assert frames[-2][1]["usage"] == {"input_tokens": 42, "output_tokens": 0}  # type: ignore[index]


# --- whole messages -----------------------------------------------------------------------


def message(
    content: list[object], stop_reason: str, usage: object, stop_sequence: str | None = None
) -> dict[str, object]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def test_accumulator_text() -> None:
    acc = accumulate([*HELLO, Finished(FinishReason.LENGTH)])
    assert acc.error() is None
    assert acc.result() == message(
        [{"type": "text", "text": "Hello"}],
        "max_tokens",
        {"input_tokens": 5, "output_tokens": 2},
    )


def test_accumulator_reports_the_matched_stop_sequence() -> None:
    acc = accumulate([*HELLO, Finished(FinishReason.STOP, stop_sequence=".")])
    assert acc.result() == message(
        [{"type": "text", "text": "Hello"}],
        "stop_sequence",
        {"input_tokens": 5, "output_tokens": 2},
        stop_sequence=".",
    )


def test_accumulator_tool_calls_parse_their_input() -> None:
    events: list[NeutralEvent] = [Started("m", 1, 5), TextDelta("Let me see.")]
    events.append(ToolCallDelta(0, "", id="t_a", name="weather"))
    events.append(ToolCallDelta(1, "{}", id="t_b", name="now"))
    events += [ToolCallDelta(0, c) for c in WEATHER]  # interleaved: fine when whole
    events += [ToolCallDelta(2, "", id="t_c", name="ping"), TextDelta("ok")]
    events += [Usage(10, 30, cached_tokens=6), Finished(FinishReason.TOOL_CALLS)]
    assert accumulate(events).result() == message(
        [
            {"type": "text", "text": "Let me see."},
            {"type": "tool_use", "id": "t_a", "name": "weather", "input": orjson.loads(WEATHER)},
            {"type": "tool_use", "id": "t_b", "name": "now", "input": {}},
            {"type": "tool_use", "id": "t_c", "name": "ping", "input": {}},
            {"type": "text", "text": "ok"},
        ],
        "tool_use",
        {"input_tokens": 4, "cache_read_input_tokens": 6, "output_tokens": 30},
    )


@pytest.mark.parametrize("arguments", ['{"city": "Par', "[1, 2]", "null"])
def test_accumulator_unusable_arguments_give_an_empty_input(arguments: str) -> None:
    events = [ToolCallDelta(0, arguments, id="t", name="f"), Finished(FinishReason.LENGTH)]
    content = accumulate(events).result()["content"]
    assert content == [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]


@pytest.mark.parametrize(
    ("terminal", "status", "body"),
    [
        (
            Finished(FinishReason.CANCELLED),
            503,
            error_body("the stream was cancelled", type="api_error"),
        ),
        (Error("backend_error", "reset"), 502, error_body("reset", type="api_error")),
        (
            Error("backend_error", "busy", retryable=True),
            503,
            error_body("busy", type="overloaded_error"),
        ),
        (Error("overloaded", "full", True), 503, error_body("full", type="overloaded_error")),
        (Error("invalid_request", "bad"), 400, error_body("bad", type="invalid_request_error")),
        (Error("internal_error", "oops"), 500, error_body("oops", type="api_error")),
    ],
)
def test_accumulator_failed_stream_gives_status_and_body(
    terminal: NeutralEvent, status: int, body: dict[str, object]
) -> None:
    assert_failed_with(accumulate([*HELLO, terminal]), status, body)


def test_accumulator_result_before_the_end_raises() -> None:
    assert_unfinished(accumulate(HELLO))


def test_accumulator_refuses_events_after_the_terminal_one() -> None:
    assert_refuses_after_terminal(accumulate([Error("backend_error", "x")]))


# --- error bodies -------------------------------------------------------------------------


def test_error_body_is_the_anthropic_envelope() -> None:
    assert orjson.dumps(error_body("no such model", type="not_found_error")) == (
        b'{"type":"error","error":{"type":"not_found_error","message":"no such model"}}'
    )


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_type_for_status(status: int, type_: str) -> None:
    assert error_type_for_status(status) == type_


# --- against the official SDK -------------------------------------------------------------

SDK_CASES: dict[str, list[NeutralEvent]] = {
    "text": [*HELLO, Finished(FinishReason.STOP)],
    "length": [*HELLO, Finished(FinishReason.LENGTH)],
    "no_usage_event": [Started("m", 1, 5), TextDelta("hi"), Finished(FinishReason.STOP)],
    "stop_sequence": [*HELLO, Finished(FinishReason.STOP, stop_sequence="\n\n")],
    "tool_whole": [
        Started("m", 1, 5),
        TextDelta("Let me check."),
        ToolCallDelta(0, WEATHER, id="toolu_1", name="weather"),
        Usage(3, 7),
        Finished(FinishReason.TOOL_CALLS),
    ],
    "tool_chars": [
        Started("m", 1, 5),
        ToolCallDelta(0, "", id="toolu_1", name="weather"),
        *[ToolCallDelta(0, c) for c in WEATHER],
        Usage(5, 11),
        Finished(FinishReason.TOOL_CALLS),
    ],
    "parallel_and_zero_args": [
        Started("m", 1, 5),
        ToolCallDelta(0, '{"city":"Oslo"}', id="t_a", name="weather"),
        ToolCallDelta(1, "{}", id="t_b", name="now"),
        ToolCallDelta(2, "", id="t_c", name="ping"),
        TextDelta("and then"),
        Usage(8, 20, cached_tokens=4),
        Finished(FinishReason.TOOL_CALLS),
    ],
}


@pytest.mark.parametrize("case", sorted(SDK_CASES))
def test_sdk_accumulates_the_stream_to_the_accumulator_result(case: str) -> None:
    pydantic = importlib.import_module("pydantic")
    sdk_types = importlib.import_module("anthropic.types")
    sdk_messages = importlib.import_module("anthropic.lib.streaming._messages")
    adapter = pydantic.TypeAdapter(sdk_types.RawMessageStreamEvent)
    events = SDK_CASES[case]
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for name, data in _frames(events):
        if name == "ping":
            continue
        event = adapter.validate_json(data)  # validated, not constructed
        snapshot = sdk_messages.accumulate_event(
            event=event, current_snapshot=snapshot, json_bufs=json_bufs
        )
    assert snapshot is not None
    expected = sdk_types.Message.model_validate(accumulate(events).result())
    assert snapshot.model_dump(mode="json", exclude_none=True) == expected.model_dump(
        mode="json", exclude_none=True
    )


def _frames(events: Sequence[NeutralEvent]) -> list[tuple[str, str]]:
    r = renderer()
    return [frame for event in events for frame in r.render(event)]


def test_sdk_reads_the_in_band_error_event() -> None:
    sdk_types = importlib.import_module("anthropic.types")
    ((name, data),) = renderer().render(Error("overloaded", "full", retryable=True))
    assert name == "error"
    parsed = sdk_types.ErrorResponse.model_validate_json(data)
    assert parsed.error.type == "overloaded_error"
    assert parsed.error.message == "full"
