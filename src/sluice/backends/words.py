"""The ``words`` backend: streams the words of the prompt back, one token per word.

A demo ("one SSE event per word") and a deterministic test source. The token texts
concatenated equal the prompt exactly, whitespace included: each token is a word with the
whitespace before it, and trailing whitespace rides on the last word. A chat request gets
its last message's words back.

Stop strings are honoured as the engine honours them: the text ends just before the
earliest place any of them occurs (the first listed wins a tie), the stop string itself is
never sent, and the stream finishes ``stop`` with that string as the
``stop_sequence``. The word ending there is cut short if the stop string begins inside
it. ``max_tokens`` still counts words of what is sent. Tools and constrained output are
refused (:func:`~sluice.backends.base.refuse_tools`).

Fault injection, for tests and demos of canary releases (a version of a model alias may
be ``words`` with faults, see :mod:`sluice.rollout.config`): ``fault_error_rate`` fails that
share of the backend's streams with a :class:`~sluice.errors.BackendError` before their
first token, spread evenly and deterministically (stream ``n``, counted from 1, fails when
``floor(n * rate)`` grows, so 0.3 fails streams 4, 7, 10, ...: exactly 3 in every 10);
``fault_latency_ms`` delays every stream's first token by that much. ``interval_ms`` paces
the words of a request that sets no pace of its own (a compatible API's, which has no
``interval_ms`` field), as a slow model would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import AsyncIterator, Iterator
from itertools import islice

from sluice.backends.base import Delta, GenerationRequest, refuse_tools
from sluice.errors import BackendError, ConfigError
from sluice.events import FinishReason, TextDelta, Usage

__all__ = [
    "WordsBackend",
    "WordsGeneration",
    "count_words",
    "cut_at_stop",
    "cut_words",
    "iter_words",
    "split_words",
]

_WORD = re.compile(r"\s*\S+")
_NON_SPACE = re.compile(r"\S")
# Words per delta when unpaced: each goes out as its own event, but the hub appends and
# wakes readers once per burst.
_UNPACED_BURST = 64
# Below this many words per cut, repeated matches are cheaper than a scanner.
_SCANNER_MIN_WORDS = 8


def cut_words(text: str, pos: int, limit: int) -> tuple[list[str], int]:
    """Up to ``limit`` tokens of ``text`` from ``pos``, and the position after them.

    The last token of the text carries the trailing whitespace, and the position is then
    ``len(text)``. Only positions are kept between calls: no regex scanner stays alive, so
    a slow stream holds little besides its prompt.
    """
    tokens: list[str] = []
    end = pos
    if limit < _SCANNER_MIN_WORDS:  # a scanner costs more to set up than a few matches
        while len(tokens) < limit and (match := _WORD.match(text, end)) is not None:
            tokens.append(match.group())
            end = match.end()
    else:
        for match in islice(_WORD.finditer(text, pos), limit):
            tokens.append(match.group())
            end = match.end()
    if _NON_SPACE.search(text, end) is None:  # only whitespace (or nothing) is left
        if tokens:
            tokens[-1] += text[end:]
        elif end < len(text):
            tokens.append(text[end:])  # a text of whitespace only: one token
        end = len(text)
    return tokens, end


def iter_words(text: str) -> Iterator[str]:
    """The tokens of ``text``, lazily: concatenated, they are ``text``."""
    pos = 0
    while pos < len(text):
        tokens, pos = cut_words(text, pos, _UNPACED_BURST)
        yield from tokens


def split_words(text: str) -> list[str]:
    """Split ``text`` into tokens whose concatenation is ``text``."""
    return list(iter_words(text))


def count_words(text: str) -> int:
    """How many tokens :func:`iter_words` gives for ``text``."""
    count = sum(1 for _ in _WORD.finditer(text))
    return count if count or not text else 1


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, str | None]:
    """``text`` up to the earliest occurrence of a stop string, and that string (``None``
    when none occurs: then ``text`` is whole). The first listed wins a tie."""
    cut: int | None = None
    matched: str | None = None
    for candidate in stop:
        index = text.find(candidate)
        if index != -1 and (cut is None or index < cut):
            cut, matched = index, candidate
    return (text, None) if cut is None else (text[:cut], matched)


class WordsGeneration:
    """One pass over the words of a prompt, paced by ``interval_s``.

    Words are cut from the prompt as they are sent, so a long, slow stream holds its
    prompt and an iterator, not a list of every word.
    """

    __slots__ = (
        "_aborted",
        "_delay_s",
        "_fail",
        "_finished",
        "_num_emitted",
        "_request",
        "_stop_sequence",
        "_text",
    )

    def __init__(
        self, request: GenerationRequest, *, fail: bool = False, delay_s: float = 0.0
    ) -> None:
        if request.messages:
            request = dataclasses.replace(request, prompt=request.messages[-1].content)
        self._request = request
        # What is sent: the prompt, up to a stop string if one occurs.
        self._text, self._stop_sequence = cut_at_stop(request.prompt, request.stop)
        self._num_emitted = 0
        self._aborted = False
        self._finished = False  # every word of the prompt was sent
        self._fail = fail  # an injected fault: fail before the first token
        self._delay_s = delay_s  # an injected delay before the first token

    @property
    def num_emitted(self) -> int:
        return self._num_emitted

    async def start(self) -> None:
        """Nothing to admit: the text is already here. Tools are refused."""
        refuse_tools(self._request)

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        request = self._request
        text = self._text
        max_tokens = request.max_tokens
        interval_s = request.interval_s
        # Paced: one word per delta. Unpaced: bursts of words, yielding the loop between.
        burst = 1 if interval_s > 0 else _UNPACED_BURST
        pos = 0
        if self._delay_s > 0:
            await asyncio.sleep(self._delay_s)
        if self._fail and not self._aborted:
            raise BackendError("injected fault (fault_error_rate of the words backend)")
        if not text and self._stop_sequence is not None and not self._aborted:
            yield Delta((), FinishReason.STOP, self._stop_sequence)  # stopped before a word
            return
        while pos < len(text) and not self._aborted:
            limit = burst if max_tokens is None else min(burst, max_tokens - self._num_emitted)
            tokens, pos = cut_words(text, pos, limit)
            self._num_emitted += len(tokens)
            reason = None
            stop_sequence = None
            if pos >= len(text):
                reason = FinishReason.STOP
                stop_sequence = self._stop_sequence
                self._finished = self._stop_sequence is None
            elif max_tokens is not None and self._num_emitted >= max_tokens:
                reason = FinishReason.LENGTH
            yield Delta(list(map(TextDelta, tokens)), reason, stop_sequence)
            if reason is not None:
                return
            await asyncio.sleep(interval_s)

    async def abort(self) -> None:
        self._aborted = True

    def usage(self) -> Usage:
        # When every word was sent, the prompt's count is known without counting again.
        prompt_tokens = self._num_emitted if self._finished else count_words(self._request.prompt)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=self._num_emitted)


class WordsBackend:
    """Serves the model ``words``, optionally with injected faults (see the module doc)."""

    def __init__(
        self,
        model: str = "words",
        *,
        fault_error_rate: float = 0.0,
        fault_latency_ms: float = 0.0,
        interval_ms: float = 0.0,
    ) -> None:
        if not 0 <= fault_error_rate <= 1:
            raise ConfigError(f"fault_error_rate must be in [0, 1], got {fault_error_rate}")
        if not 0 <= fault_latency_ms < math.inf:
            raise ConfigError(f"fault_latency_ms must be finite and >= 0, got {fault_latency_ms}")
        if not 0 <= interval_ms < math.inf:
            raise ConfigError(f"interval_ms must be finite and >= 0, got {interval_ms}")
        self._model = model
        self._fault_error_rate = fault_error_rate
        self._delay_s = fault_latency_ms / 1000
        self._interval_s = interval_ms / 1000
        self._num_streams = 0

    @property
    def model(self) -> str:
        return self._model

    def generate(self, request: GenerationRequest) -> WordsGeneration:
        self._num_streams += 1
        n, rate = self._num_streams, self._fault_error_rate
        fail = math.floor(n * rate) > math.floor((n - 1) * rate)
        if request.interval_s == 0 and self._interval_s > 0:
            request = dataclasses.replace(request, interval_s=self._interval_s)
        return WordsGeneration(request, fail=fail, delay_s=self._delay_s)

    async def aclose(self) -> None:
        return None
