"""The words backend: one token per word, text preserved exactly."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from sluice.backends.base import GenerationRequest
from sluice.backends.words import WordsBackend, count_words, split_words
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
