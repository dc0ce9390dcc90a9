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

import orjson

from sluice.events import (
    Error,
    Finished,
    NeutralEvent,
    Started,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from sluice.sse import encode_event

__all__ = ["error_frame", "frame", "render"]


def render(event: NeutralEvent) -> tuple[str, str]:
    """The SSE event name and JSON data of ``event``."""
    match event:
        case TextDelta(text=text):
            return "token", orjson.dumps({"text": text}).decode()
        case Started(model=model, created=created):
            return "start", orjson.dumps({"model": model, "created": created}).decode()
        case ToolCallDelta(index=index, arguments_delta=arguments, id=call_id, name=name):
            payload = {"index": index, "id": call_id, "name": name, "arguments": arguments}
            return "tool_call", orjson.dumps(payload).decode()
        case Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached):
            payload = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "cached_tokens": cached,
            }
            return "usage", orjson.dumps(payload).decode()
        case Finished(reason=reason):
            return "done", orjson.dumps({"reason": reason.value}).decode()
        case Error(type=code, message=message, retryable=retryable):
            payload = {"code": code, "message": message, "retryable": retryable}
            return "error", orjson.dumps(payload).decode()
    raise TypeError(f"not a neutral event: {event!r}")  # pragma: no cover - exhaustive above


def frame(event: NeutralEvent, event_id: str) -> bytes:
    """The complete SSE frame of ``event`` with SSE id ``event_id``."""
    name, data = render(event)
    return encode_event(data, event=name, id=event_id)


def error_frame(code: str, message: str, *, retryable: bool = False) -> bytes:
    """An ``error`` frame outside the log (no id): for refusals such as ``resume_gap``."""
    name, data = render(Error(type=code, message=message, retryable=retryable))
    return encode_event(data, event=name)
