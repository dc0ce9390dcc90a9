"""The Anthropic dialect: the Messages API, streamed (named events) and whole.

Pure: events in, ``(event name, JSON data)`` pairs out; the caller frames each pair as one
SSE frame and adds ids when a stream is resumable.

=====================  ===============================================================
neutral event          Anthropic events
=====================  ===============================================================
Started                ``message_start``, ``ping``
TextDelta              [``content_block_stop``, ``content_block_start`` (text)],
                       ``content_block_delta`` (``text_delta``)
ToolCallDelta (first)  [``content_block_stop``], ``content_block_start`` (``tool_use``),
                       [``content_block_delta`` (``input_json_delta``)]
ToolCallDelta (later)  ``content_block_delta`` (``input_json_delta``) when non-empty
Usage                  nothing (kept for ``message_delta``)
Finished(stop|...)     [``content_block_stop``], ``message_delta``, ``message_stop``
Finished(cancelled)    ``error`` (``api_error``); no ``message_stop``
Error                  ``error``; no ``message_stop``
=====================  ===============================================================

Decisions, numbered:

1. Blocks are sequential, as the API sends them: a block is stopped before the next one
   starts, and a text delta after a tool call opens a new text block. A fragment for a tool
   call whose block is already stopped cannot be expressed, so it raises
   :class:`~sluice.errors.ProtocolError` rather than corrupt the call's JSON.
2. The first fragment of each tool call index must carry ``id`` and ``name`` (the neutral
   contract), else ``ProtocolError``; a later one that repeats them is a continuation.
3. Rendering after the terminal event raises ``ProtocolError`` (as h11 does).
4. Usage: ``message_start`` carries ``Started.prompt_tokens`` as ``input_tokens`` (the
   prompt's real length when the backend knew it at admission, as the engine and
   ``words`` do; 0 for an upstream, whose usage comes at the end) and ``output_tokens:
   0``; ``message_delta`` carries the final cumulative ``input_tokens`` and
   ``output_tokens`` of the last ``Usage`` event (the SDK overwrites its snapshot with
   both), or those of ``message_start`` if there was none. Sluice's
   ``prompt_tokens`` counts cached tokens and Anthropic's ``input_tokens`` does not, so
   in ``message_delta`` cached tokens move to ``cache_read_input_tokens`` (present only
   when non-zero); ``message_start`` cannot split them yet (the prefix cache is looked up
   when the prompt is scheduled) and counts the whole prompt.
5. Errors share the compatible dialects' status table (:mod:`sluice.dialects.common`):
   ``invalid_request`` 400 ``invalid_request_error``; ``overloaded`` or retryable 503
   ``overloaded_error``; ``backend_error`` 502 and anything else 500 ``api_error``; a
   cancelled stream 503 ``api_error`` (a client still waiting was cancelled by a draining
   server).
6. The whole message's ``tool_use.input`` is the call's arguments parsed as a JSON object;
   empty arguments give ``{}``, and so do arguments that are not a JSON object (a call cut
   off by ``max_tokens``), since the API's ``input`` is always an object.
7. A stream that a stop string ended (``Finished(stop, stop_sequence=s)``) has
   ``stop_reason: "stop_sequence"`` and ``stop_sequence: s``, in ``message_delta`` and in
   the whole message; any other end has ``stop_sequence: null``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from sluice.dialects.base import ParsedRequest, RenderMeta, RequestLimits
from sluice.dialects.common import (
    SHARED_TYPE_BY_STATUS,
    Failure,
    WholeResponse,
    dumps,
    failure_of,
)
from sluice.dialects.requests import MessagesBody, parse_anthropic_messages
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

__all__ = ["DIALECT", "Accumulator", "MessagesRenderer", "error_body", "error_type_for_status"]

_STOP_REASON = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
}
_STOP_SEQUENCE = "stop_sequence"  # decision 7


def _stop(reason: FinishReason, stop_sequence: str | None) -> tuple[str, str | None]:
    """Decision 7: ``stop_reason`` and ``stop_sequence`` of a stream that ended well."""
    if stop_sequence is not None and reason is FinishReason.STOP:
        return _STOP_SEQUENCE, stop_sequence
    return _STOP_REASON[reason], None


_TYPE_BY_STATUS = {
    **SHARED_TYPE_BY_STATUS,
    402: "billing_error",
    413: "request_too_large",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

_PING = '{"type":"ping"}'
_MESSAGE_STOP = '{"type":"message_stop"}'


def error_type_for_status(status: int) -> str:
    """The Anthropic error ``type`` for an HTTP status."""
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, *, type: str) -> dict[str, object]:
    """Anthropic's error envelope, for refusals before a response starts."""
    return {"type": "error", "error": {"type": type, "message": message}}


def _failure_body(failure: Failure) -> dict[str, object]:
    """The error body of a stream that ended badly (decision 5); a cancelled stream's
    503 is an ``api_error``, not an ``overloaded_error``."""
    type = "api_error" if failure.cancelled else error_type_for_status(failure.status)
    return error_body(failure.message, type=type)


@dataclass(frozen=True, slots=True)
class _MessageHead:
    """What the renderer and the accumulator both know of a message before it starts."""

    message_id: str
    model: str

    def message(
        self,
        content: list[dict[str, object]],
        stop_reason: str | None,
        usage: Mapping[str, object],
        stop_sequence: str | None = None,
    ) -> dict[str, object]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def usage(self, usage: Usage | None) -> dict[str, object]:
        """Decision 4: ``usage`` as Anthropic writes it (nothing known: zeros)."""
        if usage is None:
            return {"input_tokens": 0, "output_tokens": 0}
        payload: dict[str, object] = {"input_tokens": usage.prompt_tokens - usage.cached_tokens}
        if usage.cached_tokens:
            payload["cache_read_input_tokens"] = usage.cached_tokens
        payload["output_tokens"] = usage.completion_tokens
        return payload


def _first_fragment(event: ToolCallDelta) -> tuple[str, str]:
    if event.id is None or event.name is None:
        raise ProtocolError(f"the first fragment of tool call {event.index} carries no id or name")
    return event.id, event.name


class MessagesRenderer:
    """Renders one response's neutral events as Anthropic stream events (see module doc)."""

    __slots__ = (
        "_head",
        "_num_blocks",
        "_open_block",
        "_open_is_text",
        "_terminated",
        "_tool_blocks",
        "_usage",
    )

    def __init__(self, *, message_id: str, model: str) -> None:
        self._head = _MessageHead(message_id, model)
        self._usage: Usage | None = None
        self._num_blocks = 0
        self._open_block: int | None = None  # the index of the block now open
        self._open_is_text = False
        self._tool_blocks: dict[int, int] = {}  # tool call index -> block index
        self._terminated = False

    def render(self, event: NeutralEvent) -> list[tuple[str, str]]:
        """The ``(event name, data)`` frames of ``event``.

        Raises :class:`~sluice.errors.ProtocolError` after the terminal event and for a
        tool call fragment whose block is already stopped (decisions 1 and 3).
        """
        if self._terminated:
            raise ProtocolError(
                f"Anthropic message stream: {type(event).__name__} after the terminal event"
            )
        match event:
            case TextDelta(text=text):
                frames = (
                    []
                    if self._open_is_text
                    else self._start_block(None, {"type": "text", "text": ""})
                )
                frames.append(
                    (
                        "content_block_delta",
                        f'{{"type":"content_block_delta","index":{self._open_block},'
                        f'"delta":{{"type":"text_delta","text":{orjson.dumps(text).decode()}}}}}',
                    )
                )
                return frames
            case ToolCallDelta():
                return self._tool_call(event)
            case Started(prompt_tokens=prompt_tokens):
                self._usage = Usage(prompt_tokens, 0)  # until a Usage event (decision 4)
                message = self._head.message([], None, self._head.usage(self._usage))
                return [
                    ("message_start", dumps({"type": "message_start", "message": message})),
                    ("ping", _PING),
                ]
            case Usage():
                self._usage = event
                return []
            case Finished(reason=FinishReason.CANCELLED) | Error():
                self._terminated = True
                return [("error", dumps(_failure_body(failure_of(event))))]
            case Finished(reason=reason, stop_sequence=stop_sequence):
                self._terminated = True
                frames = self._stop_block()
                stop_reason, stop_sequence = _stop(reason, stop_sequence)
                delta = {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": self._head.usage(self._usage),
                }
                frames.append(("message_delta", dumps(delta)))
                frames.append(("message_stop", _MESSAGE_STOP))
                return frames
        raise TypeError(f"not a neutral event: {event!r}")

    def _tool_call(self, event: ToolCallDelta) -> list[tuple[str, str]]:
        block = self._tool_blocks.get(event.index)
        if block is None:
            id, name = _first_fragment(event)
            frames = self._start_block(
                event.index, {"type": "tool_use", "id": id, "name": name, "input": {}}
            )
        elif block != self._open_block:
            raise ProtocolError(
                f"a fragment of tool call {event.index} after its block {block} was stopped"
            )
        else:
            frames = []
        if event.arguments_delta:
            delta = {
                "type": "content_block_delta",
                "index": self._open_block,
                "delta": {"type": "input_json_delta", "partial_json": event.arguments_delta},
            }
            frames.append(("content_block_delta", dumps(delta)))
        return frames

    def _start_block(
        self, tool_index: int | None, content_block: dict[str, object]
    ) -> list[tuple[str, str]]:
        frames = self._stop_block()
        index = self._num_blocks
        self._num_blocks += 1
        self._open_block = index
        self._open_is_text = tool_index is None
        if tool_index is not None:
            self._tool_blocks[tool_index] = index
        start = {"type": "content_block_start", "index": index, "content_block": content_block}
        frames.append(("content_block_start", dumps(start)))
        return frames

    def _stop_block(self) -> list[tuple[str, str]]:
        if self._open_block is None:
            return []
        stop = {"type": "content_block_stop", "index": self._open_block}
        self._open_block = None
        self._open_is_text = False
        return [("content_block_stop", dumps(stop))]


class _Block:
    """One content block being assembled: text, or a tool call's id, name and arguments."""

    __slots__ = ("id", "name", "parts")

    def __init__(self, id: str | None = None, name: str | None = None) -> None:
        self.id = id
        self.name = name
        self.parts: list[str] = []

    def payload(self) -> dict[str, object]:
        joined = "".join(self.parts)
        if self.id is None:
            return {"type": "text", "text": joined}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": _parse_input(joined)}


def _parse_input(arguments: str) -> dict[str, object]:
    """Decision 6: the arguments as a JSON object, or ``{}``."""
    try:
        value = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class Accumulator(WholeResponse):
    """Collects one response's neutral events into a whole Anthropic ``message``.

    Blocks follow the renderer's layout: consecutive text is one block, each tool call one
    block. Feed every event with :meth:`feed`; after the terminal one, :meth:`error` says
    whether the response failed and :meth:`result` returns the message of one that did not.
    """

    __slots__ = ("_blocks", "_head", "_tool_blocks")

    def __init__(self, *, message_id: str, model: str) -> None:
        super().__init__(description="Anthropic message", finish_reasons=_STOP_REASON)
        self._head = _MessageHead(message_id, model)
        self._blocks: list[_Block] = []
        self._tool_blocks: dict[int, _Block] = {}

    def result(self) -> dict[str, object]:
        """The whole ``message``; raises ``ProtocolError`` unless it finished well."""
        stop_reason = self._finished_well()
        stop_sequence = None
        if self._stop_sequence is not None and stop_reason == _STOP_REASON[FinishReason.STOP]:
            stop_reason, stop_sequence = _STOP_SEQUENCE, self._stop_sequence
        return self._head.message(
            [block.payload() for block in self._blocks],
            stop_reason,
            self._head.usage(self._usage),
            stop_sequence,
        )

    def _started(self, event: Started) -> None:
        self._usage = Usage(event.prompt_tokens, 0)  # until a Usage event (decision 4)

    def _text(self, text: str) -> None:
        if not self._blocks or self._blocks[-1].id is not None:
            self._blocks.append(_Block())
        self._blocks[-1].parts.append(text)

    def _tool_call(self, event: ToolCallDelta) -> None:
        block = self._tool_blocks.get(event.index)
        if block is None:
            block = _Block(*_first_fragment(event))
            self._tool_blocks[event.index] = block
            self._blocks.append(block)
        block.parts.append(event.arguments_delta)

    def _failure_body(self, failure: Failure) -> dict[str, object]:
        return _failure_body(failure)


class _AnthropicMessages:
    """The Anthropic Messages API, ``POST /v1/messages``, as a dialect."""

    __slots__ = ()

    name = "anthropic"
    path = "/v1/messages"
    response_id_prefix = "msg_"
    request_model = MessagesBody
    retry_hint = False  # see sluice.dialects.base.Dialect.retry_hint

    def parse(self, payload: object, limits: RequestLimits) -> ParsedRequest:
        return parse_anthropic_messages(payload, limits)

    def renderer(self, meta: RenderMeta) -> MessagesRenderer:
        return MessagesRenderer(message_id=meta.response_id, model=meta.model)

    def whole(self, meta: RenderMeta) -> Accumulator:
        return Accumulator(message_id=meta.response_id, model=meta.model)

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> dict[str, object]:
        return error_body(message, type=error_type_for_status(status))

    def headers(self, meta: RenderMeta) -> Mapping[str, str]:
        return {}


DIALECT = _AnthropicMessages()
