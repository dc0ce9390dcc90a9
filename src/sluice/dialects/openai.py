"""The OpenAI dialect: chat and text completions, streamed (chunks) and whole.

Pure: events in, JSON strings out. The caller frames each ``(None, data)`` pair as one
plain ``data:`` SSE frame (OpenAI names no events) and adds ids when a stream is resumable.

Streamed chat (``POST /v1/chat/completions`` with ``stream: true``)::

    Started              {"choices": [{"delta": {"role": "assistant", "content": ""}, ...}]}
    TextDelta            {"choices": [{"delta": {"content": "..."}, ...}]}
    ToolCallDelta        {"choices": [{"delta": {"tool_calls": [{"index", ...}]}, ...}]}
    Usage                nothing (kept for the usage chunk)
    Finished(stop|...)   {"choices": [{"delta": {}, "finish_reason": ...}]}
                         [{"choices": [], "usage": {...}}]   (with include_usage)
                         [DONE]
    Finished(cancelled)  {"error": {..., "code": "cancelled"}}   no [DONE]
    Error                {"error": {..., "code": <Error.type>}}  no [DONE]

Every chunk opens with ``id, object, created, model``; with ``include_usage`` every chunk
but the last carries ``"usage": null``, as OpenAI's do. Decisions, numbered:

1. ``service_tier`` is omitted (optional in the SDK), and so is ``system_fingerprint``
   except for a model alias (``--models-config``): there it names the version that served
   the response (the render option ``model_version``), in every chunk and whole object.
2. Rendering an event after the terminal one raises :class:`~sluice.errors.ProtocolError`
   (as h11 raises on an event its state forbids); it never returns a quiet ``[]``.
3. The first fragment of each tool call index must carry ``id`` and ``name`` (the neutral
   contract), else ``ProtocolError``. A later fragment that repeats them is a continuation;
   its ``id`` and ``name`` are ignored.
4. Text completions have no tools: tool call fragments render nothing there, and a
   ``tool_calls`` finish is reported as ``stop`` (the only reasons that API knows are
   ``stop``, ``length`` and ``content_filter``).
5. Errors in the stream and in whole responses share the compatible dialects' status
   table (:mod:`sluice.dialects.common`): ``invalid_request`` 400, ``overloaded`` or retryable 503, ``backend_error`` 502,
   anything else 500, a cancelled stream 503 (cancellations a client still waits for come
   from a draining server: retry elsewhere). Every 5xx has the OpenAI type ``server_error``;
   ``code`` carries the neutral ``Error.type``.
6. Usage with ``include_usage`` but no :class:`~sluice.events.Usage` event reports zeros;
   ``prompt_tokens_details`` appears only when some prompt tokens were cached.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import orjson
from pydantic import BaseModel

from sluice.dialects.base import ParsedRequest, RenderMeta, RequestLimits
from sluice.dialects.common import (
    SHARED_TYPE_BY_STATUS,
    Failure,
    WholeResponse,
    dumps,
    failure_of,
)
from sluice.dialects.requests import ChatBody, CompletionBody, parse_openai
from sluice.errors import ProtocolError
from sluice.events import (
    Error,
    Finished,
    FinishReason,
    NeutralEvent,
    Started,
    TextDelta,
    ToolCallDelta,
    Usage,
)

__all__ = [
    "DONE",
    "Accumulator",
    "ChunkRenderer",
    "CompletionKind",
    "OpenAIDialect",
    "error_body",
    "error_type_for_status",
]

CompletionKind = Literal["chat", "text"]

DONE = "[DONE]"
"""The data of the last frame of a successful stream."""

_OBJECT_CHUNK = {"chat": "chat.completion.chunk", "text": "text_completion"}
_OBJECT_WHOLE = {"chat": "chat.completion", "text": "text_completion"}

_FINISH_REASON = {
    "chat": {
        FinishReason.STOP: "stop",
        FinishReason.LENGTH: "length",
        FinishReason.TOOL_CALLS: "tool_calls",
    },
    "text": {
        FinishReason.STOP: "stop",
        FinishReason.LENGTH: "length",
        FinishReason.TOOL_CALLS: "stop",  # decision 4
    },
}

_TYPE_BY_STATUS = {
    **SHARED_TYPE_BY_STATUS,
    413: "invalid_request_error",
    422: "invalid_request_error",
}


def error_type_for_status(status: int) -> str:
    """The OpenAI error ``type`` for an HTTP status (the SDKs raise by status anyway)."""
    if status >= 500:
        return "server_error"
    return _TYPE_BY_STATUS.get(status, "invalid_request_error")


def error_body(
    message: str, *, type: str, code: str | None, param: str | None = None
) -> dict[str, object]:
    """OpenAI's error envelope, for refusals before a response starts."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _failure_body(failure: Failure) -> dict[str, object]:
    """The error body of a stream that ended badly (decision 5)."""
    return error_body(
        failure.message, type=error_type_for_status(failure.status), code=failure.code
    )


def _usage_payload(usage: Usage | None) -> dict[str, object]:
    if usage is None:
        usage = Usage(prompt_tokens=0, completion_tokens=0)
    payload: dict[str, object] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.cached_tokens:
        payload["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return payload


class _ToolCallTracker:
    """The tool call indexes seen so far; enforces decision 3."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def first(self, event: ToolCallDelta) -> tuple[str, str] | None:
        """``(id, name)`` if ``event`` is its call's first fragment, else ``None``."""
        if event.index in self._seen:
            return None
        if event.id is None or event.name is None:
            raise ProtocolError(
                f"the first fragment of tool call {event.index} carries no id or name"
            )
        self._seen.add(event.index)
        return event.id, event.name


class ChunkRenderer:
    """Renders one response's neutral events as OpenAI stream chunks (see module doc)."""

    __slots__ = (
        "_finish_reasons",
        "_head",
        "_include_usage",
        "_kind",
        "_terminated",
        "_text_prefix",
        "_text_suffix",
        "_tool_calls",
        "_usage",
    )

    def __init__(
        self,
        *,
        kind: CompletionKind,
        completion_id: str,
        model: str,
        created: int,
        include_usage: bool,
        system_fingerprint: str = "",
    ) -> None:
        self._kind = kind
        self._include_usage = include_usage
        self._finish_reasons = _FINISH_REASON[kind]
        self._head: dict[str, object] = {
            "id": completion_id,
            "object": _OBJECT_CHUNK[kind],
            "created": created,
            "model": model,
        }
        if system_fingerprint:
            self._head["system_fingerprint"] = system_fingerprint
        self._usage: Usage | None = None
        self._tool_calls = _ToolCallTracker()
        self._terminated = False
        # The hot path (one per token): the chunk around a text delta's JSON string, so a
        # token costs one small orjson call. Equal to dumping the whole dict (tested).
        head = dumps(self._head)[:-1]
        text_key = '"delta":{"content":' if kind == "chat" else '"text":'
        self._text_prefix = f'{head},"choices":[{{"index":0,{text_key}'
        self._text_suffix = (
            ("}" if kind == "chat" else "")
            + ',"logprobs":null,"finish_reason":null}]'
            + (',"usage":null}' if include_usage else "}")
        )

    def render(self, event: NeutralEvent) -> list[tuple[str | None, str]]:
        """The ``(event name, data)`` frames of ``event``; the name is always ``None``.

        Raises :class:`~sluice.errors.ProtocolError` for any event after the terminal one.
        """
        if self._terminated:
            raise ProtocolError(
                f"OpenAI {self._kind} stream: {type(event).__name__} after the terminal event"
            )
        match event:
            case TextDelta(text=text):
                data = self._text_prefix + orjson.dumps(text).decode() + self._text_suffix
                return [(None, data)]
            case Started():
                if self._kind == "text":
                    return []
                return [(None, self._chunk({"role": "assistant", "content": ""}, None))]
            case ToolCallDelta():
                if self._kind == "text":
                    return []  # decision 4
                return [(None, self._chunk({"tool_calls": [self._tool_call(event)]}, None))]
            case Usage():
                self._usage = event
                return []
            case Finished(reason=FinishReason.CANCELLED) | Error():
                self._terminated = True
                return [(None, dumps(_failure_body(failure_of(event))))]
            case Finished(reason=reason):
                self._terminated = True
                frames: list[tuple[str | None, str]] = [
                    (None, self._chunk({}, self._finish_reasons[reason]))
                ]
                if self._include_usage:
                    last = {**self._head, "choices": [], "usage": _usage_payload(self._usage)}
                    frames.append((None, dumps(last)))
                frames.append((None, DONE))
                return frames
        raise TypeError(f"not a neutral event: {event!r}")

    def _tool_call(self, event: ToolCallDelta) -> dict[str, object]:
        first = self._tool_calls.first(event)
        if first is not None:
            id, name = first
            return {
                "index": event.index,
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": event.arguments_delta},
            }
        return {"index": event.index, "function": {"arguments": event.arguments_delta}}

    def _chunk(self, delta: dict[str, object], finish_reason: str | None) -> str:
        choice: dict[str, object] = {"index": 0}
        if self._kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        chunk: dict[str, object] = {**self._head, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return dumps(chunk)


class _ToolCall:
    __slots__ = ("arguments", "id", "name")

    def __init__(self, id: str, name: str) -> None:
        self.id = id
        self.name = name
        self.arguments: list[str] = []


class Accumulator(WholeResponse):
    """Collects one response's neutral events into a whole OpenAI object (``stream: false``).

    Feed every event with :meth:`feed`; after the terminal one, :meth:`error` says whether
    the response failed, and :meth:`result` returns the ``chat.completion`` or
    ``text_completion`` object of one that did not.
    """

    __slots__ = (
        "_completion_id",
        "_created",
        "_kind",
        "_model",
        "_system_fingerprint",
        "_text_parts",
        "_tool_calls",
        "_tracker",
    )

    def __init__(
        self,
        *,
        kind: CompletionKind,
        completion_id: str,
        model: str,
        created: int,
        system_fingerprint: str = "",
    ) -> None:
        super().__init__(description=f"OpenAI {kind} response", finish_reasons=_FINISH_REASON[kind])
        self._kind = kind
        self._completion_id = completion_id
        self._model = model
        self._created = created
        self._system_fingerprint = system_fingerprint
        self._text_parts: list[str] = []
        self._tool_calls: dict[int, _ToolCall] = {}
        self._tracker = _ToolCallTracker()

    def result(self) -> dict[str, object]:
        """The whole response object; raises ``ProtocolError`` unless it finished well."""
        finish_reason = self._finished_well()
        text = "".join(self._text_parts)
        choice: dict[str, object] = {"index": 0}
        if self._kind == "chat":
            choice["message"] = self._message(text)
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        whole: dict[str, object] = {
            "id": self._completion_id,
            "object": _OBJECT_WHOLE[self._kind],
            "created": self._created,
            "model": self._model,
            "choices": [choice],
            "usage": _usage_payload(self._usage),
        }
        if self._system_fingerprint:
            whole["system_fingerprint"] = self._system_fingerprint
        return whole

    def _text(self, text: str) -> None:
        self._text_parts.append(text)

    def _tool_call(self, event: ToolCallDelta) -> None:
        if self._kind == "text":
            return  # decision 4
        first = self._tracker.first(event)
        if first is not None:
            self._tool_calls[event.index] = _ToolCall(*first)
        self._tool_calls[event.index].arguments.append(event.arguments_delta)

    def _failure_body(self, failure: Failure) -> dict[str, object]:
        return _failure_body(failure)

    def _message(self, text: str) -> dict[str, object]:
        message: dict[str, object] = {"role": "assistant"}
        message["content"] = None if not text and self._tool_calls else text
        if self._tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": "".join(call.arguments)},
                }
                for _, call in sorted(self._tool_calls.items())
            ]
        return message


class OpenAIDialect:
    """The OpenAI Chat Completions or Completions API as a dialect (see
    :mod:`sluice.dialects.openai_chat`, :mod:`sluice.dialects.openai_completions`)."""

    __slots__ = ("_kind", "name", "path", "request_model", "response_id_prefix")

    retry_hint = False  # see sluice.dialects.base.Dialect.retry_hint

    def __init__(self, kind: CompletionKind, *, name: str, path: str, prefix: str) -> None:
        self._kind: CompletionKind = kind
        self.name = name
        self.path = path
        self.response_id_prefix = prefix
        self.request_model: type[BaseModel] = ChatBody if kind == "chat" else CompletionBody

    def parse(self, payload: object, limits: RequestLimits) -> ParsedRequest:
        return parse_openai(payload, limits, chat=self._kind == "chat")

    def renderer(self, meta: RenderMeta) -> ChunkRenderer:
        return ChunkRenderer(
            kind=self._kind,
            completion_id=meta.response_id,
            model=meta.model,
            created=meta.created,
            include_usage=meta.include_usage,
            system_fingerprint=meta.option("model_version"),
        )

    def whole(self, meta: RenderMeta) -> Accumulator:
        return Accumulator(
            kind=self._kind,
            completion_id=meta.response_id,
            model=meta.model,
            created=meta.created,
            system_fingerprint=meta.option("model_version"),
        )

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> dict[str, object]:
        return error_body(message, type=error_type_for_status(status), code=code, param=param)

    def headers(self, meta: RenderMeta) -> Mapping[str, str]:
        return {}
