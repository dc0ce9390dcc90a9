"""HermesToolCallParser: text and ``<tool_call>`` blocks, however the text is split.

Each answer is fed whole, at every single split point, every two split points, and one
character at a time; the events, with adjacent text joined, must be the same each way
(the h11 way of testing a reader). Text must be passed on as soon as it cannot be the
start of a tag."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import orjson
import pytest

from sluice.backends.tool_call_parser import (
    MAX_TOOL_CALL_CHARS,
    HermesToolCallParser,
    new_tool_call_id,
)
from sluice.events import TextDelta, ToolCallDelta

Event = TextDelta | ToolCallDelta

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = ToolCallDelta(0, '{"city":"Paris"}', "call_0", "get_weather")


def ids() -> Iterator[str]:
    return (f"call_{n}" for n in itertools.count())


def parse(pieces: Sequence[str]) -> list[Event]:
    """The events of ``pieces`` fed in turn, adjacent text joined."""
    counter = ids()
    parser = HermesToolCallParser(lambda: next(counter))
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    joined: list[Event] = []
    for event in events:
        if isinstance(event, TextDelta) and joined and isinstance(joined[-1], TextDelta):
            joined[-1] = TextDelta(joined[-1].text + event.text)
        else:
            joined.append(event)
    return joined


def splits(text: str) -> Iterator[list[str]]:
    """``text`` whole, at each split point, at each pair of them, a character at a time."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        yield [text[:i], text[i:j], text[j:]]
    yield list(text)


CASES: list[tuple[str, list[Event]]] = [
    ("The capital of France is Paris.", [TextDelta("The capital of France is Paris.")]),
    (CALL, [WEATHER]),
    ("Let me look.\n" + CALL, [TextDelta("Let me look."), WEATHER]),
    (
        CALL + "\n" + CALL.replace("Paris", "Oslo"),
        [WEATHER, ToolCallDelta(1, '{"city":"Oslo"}', "call_1", "get_weather")],
    ),
    (CALL + "\n\nDone.", [WEATHER, TextDelta("Done.")]),
    (CALL + "\n \n", [WEATHER]),
    ("a < b and <tool is not a tag", [TextDelta("a < b and <tool is not a tag")]),
    ("ends in <tool_ca", [TextDelta("ends in <tool_ca")]),
    ("  spaced  \n", [TextDelta("  spaced  \n")]),
    ('<tool_call>{"name": "f"}</tool_call>', [ToolCallDelta(0, "{}", "call_0", "f")]),
    (
        '<tool_call>{"name": "f", "parameters": {"x": [1, 2]}}</tool_call>',
        [ToolCallDelta(0, '{"x":[1,2]}', "call_0", "f")],
    ),
]
MALFORMED = [
    '<tool_call>{"name": "f", "arguments": {</tool_call>',  # not JSON
    '<tool_call>["f"]</tool_call>',  # not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # an empty name
    '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": {"city": "Pa',  # cut off at the end
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_calls_and_text_are_the_same_however_the_text_is_split(
    text: str, expected: list[Event]
) -> None:
    for pieces in splits(text):
        assert parse(pieces) == expected, pieces


@pytest.mark.parametrize("text", MALFORMED)
def test_a_block_that_is_no_call_is_passed_on_as_the_text_the_model_wrote(text: str) -> None:
    for pieces in splits(text):
        assert parse(pieces) == [TextDelta(text)], pieces


@pytest.mark.parametrize("text", MALFORMED)
def test_a_block_that_is_no_call_keeps_the_text_and_line_break_before_it(text: str) -> None:
    for pieces in splits("Let me look.\n" + text):
        assert parse(pieces) == [TextDelta("Let me look.\n" + text)], pieces


def test_a_malformed_block_does_not_stop_later_calls_being_read() -> None:
    text = MALFORMED[0] + "\n" + CALL
    for pieces in splits(text):
        assert parse(pieces) == [TextDelta(MALFORMED[0]), WEATHER]


def test_text_is_passed_on_as_soon_as_it_cannot_start_a_tag() -> None:
    parser = HermesToolCallParser()
    assert parser.feed("Hello") == [TextDelta("Hello")]
    assert parser.feed(" wor") == [TextDelta(" wor")]
    assert parser.feed("ld <") == [TextDelta("ld")]  # " <" may start a tag: held
    assert parser.feed("b") == [TextDelta(" <b")]
    assert parser.feed(" <tool_") == []
    assert parser.feed("x") == [TextDelta(" <tool_x")]
    assert parser.finish() == []
    assert parser.num_calls == 0


def test_a_call_is_reported_once_its_end_tag_arrives() -> None:
    parser = HermesToolCallParser(lambda: "call_a")
    assert parser.feed('<tool_call>{"name": "get_weather", ') == []
    assert parser.feed('"arguments": {"city": "Paris"}}\n</tool_') == []
    assert parser.feed("call>") == [ToolCallDelta(0, '{"city":"Paris"}', "call_a", "get_weather")]
    assert parser.num_calls == 1


def test_an_unclosed_block_past_the_limit_is_given_up_as_text() -> None:
    parser = HermesToolCallParser()
    body = "x" * (MAX_TOOL_CALL_CHARS + 1)
    assert parser.feed("<tool_call>" + body) == [TextDelta("<tool_call>" + body)]
    assert parser.feed("</tool_call>") == [TextDelta("</tool_call>")]
    assert parser.num_calls == 0


def test_arguments_keep_unicode_and_nesting_as_compact_json() -> None:
    arguments = {"city": "Zürich", "when": {"days": [1, 2]}, "quote": "<b>"}
    call = {"name": "f", "arguments": arguments}
    text = f"<tool_call>{orjson.dumps(call).decode()}</tool_call>"
    ((event,),) = [parse([text])]
    assert isinstance(event, ToolCallDelta)
    assert orjson.loads(event.arguments_delta) == arguments
    assert event.arguments_delta == orjson.dumps(arguments).decode()


def test_new_ids_are_distinct_and_named_as_calls() -> None:
    made = {new_tool_call_id() for _ in range(100)}
    assert len(made) == 100
    assert all(i.startswith("call_") and len(i) == 29 for i in made)
