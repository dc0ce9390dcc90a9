"""Neutral stream events: what a producer appends to a stream's log.

Every transport and dialect renders these; none of them knows about SSE, JSON or HTTP.
They are frozen values that compare by value, so tests can say ``assert events == [...]``.
Exactly one terminal event (:class:`Finished` or :class:`Error`) ends every stream.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Error",
    "FinishReason",
    "Finished",
    "NeutralEvent",
    "Payload",
    "RenderMeta",
    "Started",
    "TextDelta",
    "ToolCallDelta",
    "Usage",
    "is_terminal",
]


class FinishReason(enum.StrEnum):
    """Why a stream ended without an error."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Started:
    """The stream exists and its producer has begun; ``created`` is Unix seconds.

    ``prompt_tokens`` is the prompt's length in tokens as the backend knew it when it
    admitted the work (the engine and ``words`` do; 0 when it does not yet, as for an
    upstream, which reports usage at the end); the final count is in :class:`Usage`.
    """

    model: str
    created: int
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of generated text (one token, or several coalesced)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of a tool call; ``id`` and ``name`` come with the first fragment only."""

    index: int
    arguments_delta: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of the generation so far (recorded for cancelled streams too)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    """Terminal: the stream ended for ``reason``; ``stop_sequence`` is the stop string that
    ended it, when one did (``reason`` is then ``stop``)."""

    reason: FinishReason
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class Error:
    """Terminal: the stream failed. ``type`` is a stable code such as ``backend_error``."""

    type: str
    message: str
    retryable: bool = False


@dataclass(frozen=True, slots=True)
class Payload:
    """Bytes a client appended to a durable stream (the write side of the Durable Streams
    protocol, :mod:`sluice.streams.durable`): one append, as stored. A generation never
    produces one, and no dialect renders one: durable streams are read only through
    ``/v1/ds/``. For a JSON stream, ``data`` is the append's messages, each compact JSON,
    joined by commas (``num_messages`` of them); else the request body's bytes."""

    data: bytes
    num_messages: int = 1


NeutralEvent = Started | TextDelta | ToolCallDelta | Usage | Finished | Error | Payload


_TERMINAL_TYPES = (Finished, Error)


def is_terminal(event: NeutralEvent) -> bool:
    """True for the events that end a stream."""
    return type(event) in _TERMINAL_TYPES  # exact types: cheaper than isinstance, per batch


@dataclass(frozen=True, slots=True)
class RenderMeta:
    """How one stream renders in its dialect (see :mod:`sluice.dialects`), fixed at
    creation and kept with the stream; plain values only, so a shared registry (Redis) can
    hold it. The hub only keeps it: no layer below the dialects reads it.

    ``dialect`` is the registry name. ``options`` holds what a dialect alone needs (for
    example the Responses API's ``instructions``), as sorted ``(name, value)`` pairs.
    """

    dialect: str
    response_id: str
    model: str
    created: int
    resumable: bool
    include_usage: bool = False
    options: tuple[tuple[str, str], ...] = ()

    def option(self, name: str, default: str = "") -> str:
        for key, value in self.options:
            if key == name:
                return value
        return default
