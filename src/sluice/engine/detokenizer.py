"""Incremental detokenization: token bytes in, text out, UTF-8 safe, stop strings held back.

A byte-level BPE token is a run of bytes that need not end on a character boundary (an
emoji can take several tokens). :class:`IncrementalDetokenizer` decodes with an
incremental UTF-8 decoder, so a character split across tokens is released whole, never as
U+FFFD. It also holds back any text that could be the beginning of a stop string, so a
stop string split across tokens is still caught and never leaks into the output: text is
released only once it can no longer be part of a match.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Releases the text of a generation as it becomes final."""

    __slots__ = ("_decoder", "_pending", "_stops", "stop")

    def __init__(self, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stop)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded, not yet released: may be the start of a stop string
        self.stop: str | None = None  # the stop string that ended the text, once matched

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now final (possibly ``""``)."""
        if self.stop is not None:
            return ""
        self._pending += self._decoder.decode(piece)
        return self._release(final=False)

    def flush(self) -> str:
        """The generation ended: release what is held (an unfinished character as U+FFFD)."""
        if self.stop is not None:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        pending = self._pending
        if not self._stops:
            self._pending = ""
            return pending
        # The earliest stop string wins; everything from it on is dropped.
        cut = -1
        for stop in self._stops:
            index = pending.find(stop)
            if index != -1 and (cut == -1 or index < cut):
                cut, self.stop = index, stop
        if cut != -1:
            self._pending = ""
            return pending[:cut]
        keep = 0 if final else self._held_suffix(pending)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
