"""Tool calls in a model's text: Hermes-style ``<tool_call>{json}</tool_call>``, sans-IO.

A model whose chat template renders ``tools`` (Hermes 2 Pro, Qwen 2.5 and 3, SmolLM3,
...) calls a tool by writing, in its answer::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`HermesToolCallParser` reads that text as the engine produces it, piece by piece
(``feed(text)`` returns the events it can decide on now; ``finish()`` those left at the
end), and turns it into neutral events: :class:`~sluice.events.TextDelta` for the text
around the calls and one :class:`~sluice.events.ToolCallDelta` per complete call (``index``
counts calls from 0; ``id`` is new, ``call_`` and 24 random hex digits; ``name``; the
arguments as compact JSON). No I/O, no event loop; the engine backend calls it.

Rules, numbered:

1. Text outside a call is passed on as soon as it cannot be the start of ``<tool_call>``:
   a piece that ends in ``<tool`` is held until the next piece shows what follows.
   Whitespace at the end of a piece is held too (rule 2 may drop it). What is held is at
   most the tag's start and a run of whitespace, bounded by the answer's length.
2. Whitespace that only separates calls from each other or from the text is dropped (the
   line breaks around ``<tool_call>`` and ``</tool_call>``, what follows the last call), as
   vLLM's Hermes parser does; the text itself is passed on unchanged.
3. A call is decided when its ``</tool_call>`` arrives, and reported whole: its body must
   be a JSON object with a non-empty string ``name`` and an ``arguments`` object (or
   ``parameters``, as some models write it; absent: ``{}``).
4. A body that is not that (malformed JSON, no name, arguments that are not an object) is
   no call: it is passed on as text, tags and the whitespace before them included, exactly
   as the model wrote it. The client sees what the model said, and the stream does not fail
   for a model's slip.
5. A call still open at the end (cut off by ``max_tokens``), or longer than
   :data:`MAX_TOOL_CALL_CHARS`, is passed on as text the same way.
6. The tool's name is not checked against the request's tools: as with OpenAI's and vLLM's
   servers, that is the client's to judge.

:attr:`HermesToolCallParser.num_calls` says how many calls were made: the backend reports
``finish_reason: tool_calls`` when the answer ended normally after at least one.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import orjson

from sluice.events import TextDelta, ToolCallDelta

__all__ = [
    "CALL_END",
    "CALL_START",
    "MAX_TOOL_CALL_CHARS",
    "HermesToolCallParser",
    "new_tool_call_id",
]

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
# The most characters one call's body may hold before it is given up as text (rule 5):
# a call's arguments are a few hundred characters; this bounds the held text of a model
# that opened a call and never closes it, well below any context length in characters.
MAX_TOOL_CALL_CHARS = 256 * 1024

Event = TextDelta | ToolCallDelta


def new_tool_call_id() -> str:
    """A fresh tool call id: ``call_`` and 96 random bits in hex."""
    return "call_" + secrets.token_hex(12)


def _held_prefix_len(text: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of CALL_START."""
    if "<" not in text[1 - len(CALL_START) :]:  # the usual piece: nothing to hold
        return 0
    for size in range(min(len(text), len(CALL_START) - 1), 0, -1):
        if CALL_START.startswith(text[-size:]):
            return size
    return 0


class HermesToolCallParser:
    """Splits one answer's text into text and tool calls (see the module doc)."""

    __slots__ = ("_buffer", "_gap", "_in_call", "_new_id", "_next_to_call", "num_calls")

    def __init__(self, new_id: Callable[[], str] = new_tool_call_id) -> None:
        self._new_id = new_id
        self._buffer = ""  # outside a call: held text; inside: the call's body so far
        self._in_call = False
        self._gap = ""  # the whitespace before the open call's tag, dropped if it is one
        self._next_to_call = False  # the last thing passed on was a call (rule 2)
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        """The events decided by ``text``, the answer's next piece."""
        events: list[Event] = []
        self._buffer += text
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_END)
                if end < 0:
                    if len(self._buffer) > MAX_TOOL_CALL_CHARS:  # rule 5
                        self._text(self._gap + CALL_START + self._buffer, events)
                        self._buffer, self._in_call = "", False
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_END) :]
                self._in_call = False
                self._call(body, events)
                continue
            start = self._buffer.find(CALL_START)
            if start < 0:
                break
            before, self._buffer = self._buffer[:start], self._buffer[start + len(CALL_START) :]
            text = before.rstrip()  # rule 2: the break before the tag
            self._text(text, events)
            self._gap, self._in_call = before[len(text) :], True
        held = _held_prefix_len(self._buffer)
        ready = self._buffer[: len(self._buffer) - held]
        passed = ready.rstrip()  # rule 1: trailing whitespace waits
        self._buffer = ready[len(passed) :] + self._buffer[len(ready) :]
        self._text(passed, events)
        return events

    def finish(self) -> list[Event]:
        """The events left once the answer is complete (rules 2 and 5)."""
        events: list[Event] = []
        if self._in_call:
            self._text(self._gap + CALL_START + self._buffer, events)
        elif not (self._next_to_call and not self._buffer.strip()):
            self._text(self._buffer, events)
        self._buffer, self._in_call = "", False
        return events

    def _text(self, text: str, events: list[Event]) -> None:
        if self._next_to_call:
            text = text.lstrip()  # rule 2: the break after a call
        if text:
            events.append(TextDelta(text))
            self._next_to_call = False

    def _call(self, body: str, events: list[Event]) -> None:
        parsed = _parse_call(body)
        if parsed is None:  # rule 4
            self._text(self._gap + CALL_START + body + CALL_END, events)
            return
        name, arguments = parsed
        events.append(ToolCallDelta(self.num_calls, arguments, self._new_id(), name))
        self.num_calls += 1
        self._next_to_call = True


def _parse_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments as compact JSON)`` of a call's body, or None (rule 3)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, orjson.dumps(arguments).decode()
