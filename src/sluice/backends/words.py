"""The ``words`` backend: streams the words of the prompt back, one token per word.

A demo ("one SSE event per word") and a deterministic test source. The token texts
concatenated equal the prompt exactly, whitespace included: each token is a word with the
whitespace before it, and trailing whitespace rides on the last word.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

from sluice.backends.base import Delta, GenerationRequest
from sluice.events import FinishReason, Usage

__all__ = ["WordsBackend", "WordsGeneration", "split_words"]

_WORD = re.compile(r"\s*\S+")


def split_words(text: str) -> list[str]:
    """Split ``text`` into tokens whose concatenation is ``text``."""
    tokens = _WORD.findall(text)
    if not tokens:
        return [text] if text else []
    consumed = sum(map(len, tokens))
    if consumed < len(text):
        tokens[-1] += text[consumed:]
    return tokens


class WordsGeneration:
    """One pass over the words of a prompt, paced by ``interval_s``."""

    def __init__(self, request: GenerationRequest) -> None:
        self._request = request
        self._words = split_words(request.prompt)
        self._num_emitted = 0
        self._aborted = False

    @property
    def num_emitted(self) -> int:
        return self._num_emitted

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        words = self._words
        limit = len(words)
        max_tokens = self._request.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        interval_s = self._request.interval_s
        for i in range(limit):
            if i and interval_s > 0:
                await asyncio.sleep(interval_s)
            if self._aborted:
                return
            self._num_emitted += 1
            last = i == limit - 1
            reason = None
            if last:
                reason = FinishReason.LENGTH if limit < len(words) else FinishReason.STOP
            yield Delta(words[i], reason)

    async def abort(self) -> None:
        self._aborted = True

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self._words), completion_tokens=self._num_emitted)


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
