"""The native Sluice dialect: named SSE events whose data is JSON.

=========  ==========================================================================
event      data
=========  ==========================================================================
start      ``{"model": str, "created": int}``
token      ``{"text": str}``
tool_call  ``{"index": int, "id": str|null, "name": str|null, "arguments": str}``
usage      ``{"prompt_tokens": int, "completion_tokens": int, "cached_tokens": int}``
done       ``{"reason": "stop"|"length"|"tool_calls"|"cancelled"}``  (terminal)
error      ``{"code": str, "message": str, "retryable": bool}``      (terminal)
=========  ==========================================================================

Every event carries the SSE id ``<stream_id>:<n>``; a frame is encoded once, when it is
appended to the log, and written as is to every reader.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson

from sluice.dialects.base import Message, RenderMeta
from sluice.events import (
    Error,
    Finished,
    NeutralEvent,
    Started,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from sluice.sse import EventEncoder, encode_event

__all__ = ["DIALECT", "error_frame", "frame", "render"]

_encode_token = EventEncoder("token")


def _token(event: TextDelta) -> tuple[str, str]:
    return "token", orjson.dumps({"text": event.text}).decode()


def _start(event: Started) -> tuple[str, str]:
    return "start", orjson.dumps({"model": event.model, "created": event.created}).decode()


def _tool_call(event: ToolCallDelta) -> tuple[str, str]:
    payload = {
        "index": event.index,
        "id": event.id,
        "name": event.name,
        "arguments": event.arguments_delta,
    }
    return "tool_call", orjson.dumps(payload).decode()


def _usage(event: Usage) -> tuple[str, str]:
    payload = {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "cached_tokens": event.cached_tokens,
    }
    return "usage", orjson.dumps(payload).decode()


def _done(event: Finished) -> tuple[str, str]:
    return "done", orjson.dumps({"reason": event.reason.value}).decode()


def _error(event: Error) -> tuple[str, str]:
    payload = {"code": event.type, "message": event.message, "retryable": event.retryable}
    return "error", orjson.dumps(payload).decode()


# Dispatch on the exact type: one dict lookup per event on the hot path.
_RENDERERS: dict[type, Callable[[Any], tuple[str, str]]] = {
    TextDelta: _token,
    Started: _start,
    ToolCallDelta: _tool_call,
    Usage: _usage,
    Finished: _done,
    Error: _error,
}


def render(event: NeutralEvent) -> tuple[str, str]:
    """The SSE event name and JSON data of ``event``."""
    renderer = _RENDERERS.get(type(event))
    if renderer is None:
        raise TypeError(f"not a neutral event: {event!r}")
    return renderer(event)


def frame(event: NeutralEvent, event_id: str) -> bytes:
    """The complete SSE frame of ``event`` with SSE id ``event_id``."""
    if type(event) is TextDelta:  # the hot path: one per token
        return _encode_token(orjson.dumps({"text": event.text}).decode(), event_id)
    name, data = render(event)
    return encode_event(data, event=name, id=event_id)


def error_frame(
    code: str, message: str, *, retryable: bool = False, event_id: str | None = None
) -> bytes:
    """An ``error`` frame outside the log: for refusals such as ``resume_gap`` (with the
    id of the reader's position, so that a reconnect names it and is refused for good)."""
    name, data = render(Error(type=code, message=message, retryable=retryable))
    return encode_event(data, event=name, id=event_id)


class _NativeRenderer:
    """Native events depend on nothing before them: one message each."""

    __slots__ = ()

    def render(self, event: NeutralEvent) -> Sequence[Message]:
        return (render(event),)


class _Native:
    """The native dialect (its streams are created by ``POST /v1/streams``, a JSON answer,
    and read as SSE)."""

    __slots__ = ()

    name = "native"
    retry_hint = True  # EventSource reconnects by itself

    def renderer(self, meta: RenderMeta) -> _NativeRenderer:
        return _RENDERER


_RENDERER = _NativeRenderer()
DIALECT = _Native()
