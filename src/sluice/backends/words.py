"""The ``words`` backend: streams the words of the prompt back, one token per word.

A demo ("one SSE event per word") and a deterministic test source. The token texts
concatenated equal the prompt exactly, whitespace included: each token is a word with the
whitespace before it, and trailing whitespace rides on the last word.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator

from sluice.backends.base import Delta, GenerationRequest
from sluice.events import FinishReason, TextDelta, Usage

__all__ = ["WordsBackend", "WordsGeneration", "count_words", "iter_words", "split_words"]

_WORD = re.compile(r"\s*\S+")
# Words per delta when unpaced: each goes out as its own event, but the hub appends and
# wakes readers once per burst.
_UNPACED_BURST = 64


def iter_words(text: str) -> Iterator[str]:
    """The tokens of ``text``, lazily: concatenated, they are ``text``.

    The state between tokens is one position (no regex scanner is kept alive), so a slow
    stream holds little besides its prompt.
    """
    match = _WORD.match(text, 0)
    if match is None:
        if text:
            yield text  # whitespace only: one token
        return
    while True:
        following = _WORD.match(text, match.end())
        if following is None:
            yield text[match.start() :]  # trailing whitespace rides on the last word
            return
        yield match.group()
        match = following


def split_words(text: str) -> list[str]:
    """Split ``text`` into tokens whose concatenation is ``text``."""
    return list(iter_words(text))


def count_words(text: str) -> int:
    """How many tokens :func:`iter_words` gives for ``text``."""
    count = sum(1 for _ in _WORD.finditer(text))
    return count if count or not text else 1


class WordsGeneration:
    """One pass over the words of a prompt, paced by ``interval_s``.

    Words are cut from the prompt as they are sent, so a long, slow stream holds its
    prompt and an iterator, not a list of every word.
    """

    def __init__(self, request: GenerationRequest) -> None:
        self._request = request
        self._num_emitted = 0
        self._aborted = False
        self._finished = False  # every word of the prompt was sent

    @property
    def num_emitted(self) -> int:
        return self._num_emitted

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        request = self._request
        max_tokens = request.max_tokens
        interval_s = request.interval_s
        # Paced: one word per delta. Unpaced: bursts of words, yielding the loop between.
        burst = 1 if interval_s > 0 else _UNPACED_BURST
        words = iter_words(request.prompt)
        word = next(words, None)
        while word is not None and not self._aborted:
            events: list[TextDelta] = []
            reason = None
            while word is not None and len(events) < burst:
                following = next(words, None)
                events.append(TextDelta(word))
                self._num_emitted += 1
                if following is None:
                    reason = FinishReason.STOP
                    self._finished = True
                elif max_tokens is not None and self._num_emitted >= max_tokens:
                    reason = FinishReason.LENGTH
                    following = None
                word = following
            yield Delta(events, reason)
            if word is not None:
                await asyncio.sleep(interval_s)

    async def abort(self) -> None:
        self._aborted = True

    def usage(self) -> Usage:
        # When every word was sent, the prompt's count is known without counting again.
        prompt_tokens = self._num_emitted if self._finished else count_words(self._request.prompt)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=self._num_emitted)


class WordsBackend:
    """Serves the model ``words``."""

    def __init__(self, model: str = "words") -> None:
        self._model = model

    @property
    def model(self) -> str:
        return self._model

    def generate(self, request: GenerationRequest) -> WordsGeneration:
        return WordsGeneration(request)

    async def aclose(self) -> None:
        return None
