"""The words backend: one token per word, text preserved exactly, stop strings honoured
as a model honours them, tools refused."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.backends.base import (
    ChatMessage,
    GenerationRequest,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from sluice.backends.words import WordsBackend, count_words, split_words
from sluice.errors import BackendError, BadRequestError, ConfigError
from sluice.events import FinishReason, TextDelta, ToolCallDelta, Usage


@given(st.text())
def test_tokens_concatenate_to_the_text_exactly(text: str) -> None:
    tokens = split_words(text)
    assert "".join(tokens) == text
    assert all(tokens)
    assert len(tokens) == max(len(text.split()), 1 if text else 0) == count_words(text)


def test_each_token_is_a_word_with_the_whitespace_before_it() -> None:
    assert split_words("  one two\n three ") == ["  one", " two", "\n three "]
    assert split_words("   ") == ["   "]
    assert split_words("") == []


def collect(prompt: str, **kwargs: float | int | None) -> tuple[list[tuple[str, object]], Usage]:
    async def run() -> tuple[list[tuple[str, object]], Usage]:
        generation = WordsBackend().generate(GenerationRequest(prompt, **kwargs))  # type: ignore[arg-type]
        deltas = [
            ("".join(e.text for e in d.events), d.finish_reason)  # type: ignore[union-attr]
            async for d in generation
        ]
        return deltas, generation.usage()

    return asyncio.run(run())


def test_paced_generation_yields_one_word_per_delta_and_stop_on_the_last() -> None:
    deltas, usage = collect("a b c", interval_s=0.001)
    assert deltas == [("a", None), (" b", None), (" c", FinishReason.STOP)]
    assert usage == Usage(prompt_tokens=3, completion_tokens=3)


def test_a_backend_interval_paces_requests_that_set_none() -> None:
    async def run(backend: WordsBackend) -> list[int]:
        return [len(d.events) async for d in backend.generate(GenerationRequest("a b c"))]

    assert asyncio.run(run(WordsBackend())) == [3]  # unpaced: one burst
    assert asyncio.run(run(WordsBackend(interval_ms=1))) == [1, 1, 1]  # paced: a word a delta


def test_unpaced_generation_bursts_words_one_event_each() -> None:
    async def run() -> list[list[TextDelta | ToolCallDelta]]:
        generation = WordsBackend().generate(GenerationRequest("w " * 150))
        return [list(d.events) async for d in generation]

    bursts = asyncio.run(run())
    assert [len(b) for b in bursts] == [64, 64, 22]
    assert all(isinstance(e, TextDelta) and e.text.strip() == "w" for b in bursts for e in b)


def test_max_tokens_cuts_with_length() -> None:
    for interval_s in (0.0, 0.001):
        deltas, usage = collect("a b c", max_tokens=2, interval_s=interval_s)
        assert "".join(text for text, _ in deltas) == "a b"
        assert deltas[-1][1] is FinishReason.LENGTH
        assert usage == Usage(prompt_tokens=3, completion_tokens=2)


def test_abort_stops_emitting() -> None:
    async def run() -> tuple[list[str], Usage]:
        generation = WordsBackend().generate(GenerationRequest("a b c d", interval_s=0.001))
        seen = []
        async for delta in generation:
            seen.extend(e.text for e in delta.events)  # type: ignore[union-attr]
            if len(seen) == 2:
                await generation.abort()
        return seen, generation.usage()

    seen, usage = asyncio.run(run())
    assert seen == ["a", " b"]
    assert usage.completion_tokens == 2


def finish(prompt: str, **kwargs: object) -> tuple[str, FinishReason | None, str | None, Usage]:
    """The text, finish reason, stop sequence and usage of one generation."""

    async def run() -> tuple[str, FinishReason | None, str | None, Usage]:
        generation = WordsBackend().generate(GenerationRequest(prompt, **kwargs))  # type: ignore[arg-type]
        await generation.start()
        deltas = [delta async for delta in generation]
        text = "".join(e.text for d in deltas for e in d.events)  # type: ignore[union-attr]
        last = deltas[-1]
        return text, last.finish_reason, last.stop_sequence, generation.usage()

    return asyncio.run(run())


def test_the_text_ends_before_the_earliest_stop_string_which_is_reported() -> None:
    for interval_s in (0.0, 0.001):
        assert finish("one two three", stop=("three", "two"), interval_s=interval_s) == (
            "one ",
            FinishReason.STOP,
            "two",
            Usage(prompt_tokens=3, completion_tokens=1),
        )


def test_a_stop_string_inside_a_word_cuts_the_word_and_ties_go_to_the_first_listed() -> None:
    text, reason, stop, _ = finish("alpha beta", stop=("ta", "t"))
    assert (text, reason, stop) == ("alpha be", FinishReason.STOP, "ta")


def test_a_stop_string_at_the_start_ends_the_stream_with_no_text() -> None:
    text, reason, stop, usage = finish("stop here", stop=("stop",))
    assert (text, reason, stop) == ("", FinishReason.STOP, "stop")
    assert usage == Usage(prompt_tokens=2, completion_tokens=0)


def test_max_tokens_before_the_stop_string_is_length_and_no_stop_sequence() -> None:
    text, reason, stop, _ = finish("a b c d", stop=("d",), max_tokens=2)
    assert (text, reason, stop) == ("a b", FinishReason.LENGTH, None)


def test_a_stop_string_that_never_occurs_changes_nothing() -> None:
    text, reason, stop, _ = finish("a b", stop=("z",))
    assert (text, reason, stop) == ("a b", FinishReason.STOP, None)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tools": (Tool("f"),)}, "tools:"),
        ({"tools": (Tool("f"),), "tool_choice": ToolChoice(ToolChoiceMode.AUTO)}, "tools:"),
        ({"tool_choice": ToolChoice(ToolChoiceMode.REQUIRED)}, "tool_choice:"),
        ({"tool_choice": ToolChoice(ToolChoiceMode.FUNCTION, "f")}, "tool_choice:"),
        ({"response_format": ResponseFormat("json_object")}, "response_format:"),
        ({"messages": (ChatMessage("assistant", "", (ToolCall("c", "f", "{}"),)),)}, "messages:"),
    ],
)
def test_tools_are_refused_naming_the_field(fields: dict[str, object], needle: str) -> None:
    generation = WordsBackend().generate(GenerationRequest("a", **fields))  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match=needle):
        asyncio.run(generation.start())


def test_tools_the_model_must_not_call_and_a_text_format_are_accepted() -> None:
    text, reason, _, _ = finish(
        "a b",
        tools=(Tool("f"),),
        tool_choice=ToolChoice(ToolChoiceMode.NONE),
        response_format=ResponseFormat("text"),
    )
    assert (text, reason) == ("a b", FinishReason.STOP)


async def _first_delta_or_error(backend: WordsBackend) -> str:
    generation = backend.generate(GenerationRequest(prompt="one two"))
    await generation.start()
    try:
        async for delta in generation:
            return "".join(e.text for e in delta.events if isinstance(e, TextDelta))
    except BackendError as exc:
        return f"error: {exc}"
    return ""


def test_fault_error_rate_fails_that_share_of_streams_evenly_and_deterministically() -> None:
    backend = WordsBackend(fault_error_rate=0.3)

    async def run() -> list[str]:
        return [await _first_delta_or_error(backend) for _ in range(20)]

    results = asyncio.run(run())
    failed = [n for n, result in enumerate(results, start=1) if result.startswith("error: ")]
    assert failed == [4, 7, 10, 14, 17, 20]
    assert "injected fault" in results[3]
    assert results[0] == "one two"


def test_no_faults_by_default_and_every_stream_fails_at_rate_one() -> None:
    async def run(backend: WordsBackend) -> list[str]:
        return [await _first_delta_or_error(backend) for _ in range(5)]

    assert asyncio.run(run(WordsBackend())) == ["one two"] * 5
    assert all(r.startswith("error: ") for r in asyncio.run(run(WordsBackend(fault_error_rate=1))))


def test_fault_latency_delays_the_first_token_by_at_least_that_much() -> None:
    backend = WordsBackend(fault_latency_ms=50)

    async def run() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await _first_delta_or_error(backend) == "one two"
        return loop.time() - started

    # A lower bound (less the loop clock's resolution): a busy machine only adds to it.
    assert asyncio.run(run()) >= 0.05 - 0.001


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fault_error_rate": 1.5}, "fault_error_rate"),
        ({"fault_latency_ms": -1}, "fault_latency_ms"),
        ({"interval_ms": -1}, "interval_ms"),
    ],
)
def test_bad_fault_options_are_refused(options: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WordsBackend(**options)
