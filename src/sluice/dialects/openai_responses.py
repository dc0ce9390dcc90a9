"""The OpenAI Responses dialect: ``POST /v1/responses``, streamed (typed events) and whole.

Pure: events in, ``(event name, JSON data)`` messages out. Every message is named by its
``type``, which its JSON repeats, and carries ``sequence_number``; transports frame them
(SSE ``event:``/``data:``, later WebSocket text frames) and add ids. The request body is
parsed by :mod:`sluice.dialects.openai_responses_request`.

=====================  ===============================================================
neutral event          Responses events
=====================  ===============================================================
Started                ``response.created``, ``response.in_progress``
TextDelta              [close the open item], [``response.output_item.added`` (message),
                       ``response.content_part.added`` (output_text)],
                       ``response.output_text.delta``
ToolCallDelta (first)  [close the open item], ``response.output_item.added``
                       (function_call), [``response.function_call_arguments.delta``]
ToolCallDelta (later)  ``response.function_call_arguments.delta`` when non-empty
Usage                  nothing (kept for the terminal event)
Finished(stop|tools)   [close the open item], ``response.completed``
Finished(length)       [close the open item as incomplete], ``response.incomplete``
Finished(cancelled)    ``error`` (code ``cancelled``), ``response.failed``
Error                  ``error`` (code ``Error.type``), ``response.failed``
=====================  ===============================================================

Closing a message item is ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; closing a function call is
``response.function_call_arguments.done``, ``response.output_item.done``. Decisions, numbered:

1. ``sequence_number`` counts a stream's messages from 0 (``response.created``), as
   OpenAI's do; a resumed reader renders the events before its position again, so the
   numbers it gets are the ones the first reader got.
2. Output items are sequential: text opens a ``message`` item with one ``output_text``
   part, each tool call a ``function_call`` item, and an item is closed before the next
   opens (text after a call opens a new message). A fragment for a call whose item is
   closed cannot be expressed and raises :class:`~sluice.errors.ProtocolError`; so does a
   first fragment without ``id`` and ``name`` (the neutral contract).
3. Item ids derive from the response id (``msg_<suffix>_<output index>``,
   ``fc_<suffix>_<output index>``), so every reader and every resume sees the same ones; a
   call's ``call_id`` is the neutral call id.
4. A length cut closes the open item with status ``incomplete`` and ends with
   ``response.incomplete`` (``incomplete_details.reason: "max_output_tokens"``); whole, it
   is a 200 with that status, as OpenAI answers.
5. A stream that ended badly sends ``error`` (``code`` the neutral ``Error.type``, as the
   chat dialect's ``code``, ``cancelled`` for a cancel) and then ``response.failed`` (status
   ``failed``, or ``cancelled`` for a cancel, with ``response.error`` and the output so far,
   its open item ``incomplete``): a client that watches either sees the end, and the
   SDK's stream helper sees the lifecycle close. ``response.error.code`` is one of the
   SDK's codes (``rate_limit_exceeded`` for 429, ``invalid_prompt`` for other 4xx,
   ``server_error`` else) and ``response.error.type`` the neutral type. Whole, the answer is
   the shared status table's (:mod:`sluice.dialects.common`) with OpenAI's error body.
6. Usage is on every terminal response: ``input_tokens`` counts cached tokens (as
   OpenAI's does; ``input_tokens_details.cached_tokens`` says how many),
   ``reasoning_tokens`` and ``cache_write_tokens`` are 0. With no ``Usage`` event it is
   ``Started.prompt_tokens`` and 0.
7. The response object echoes what the request set (``instructions``, ``temperature``,
   ``top_p``, ``max_output_tokens``, ``tools``, ``tool_choice``, ``parallel_tool_calls``,
   ``text``), kept as the JSON option ``echo`` of :class:`~sluice.dialects.base.RenderMeta`.
   Sluice stores no responses: ``store`` is ``false`` and ``previous_response_id`` null.
8. Rendering after the terminal event raises ``ProtocolError`` (as h11 does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import orjson

from sluice.dialects import openai
from sluice.dialects.base import Message, ParsedRequest, RequestLimits
from sluice.dialects.common import Failure, WholeResponse, dumps, failure_of
from sluice.dialects.openai_responses_request import ResponsesBody, parse_responses
from sluice.errors import ProtocolError
from sluice.events import (
    Error,
    Finished,
    FinishReason,
    NeutralEvent,
    RenderMeta,
    Started,
    TextDelta,
    ToolCallDelta,
    Usage,
)

__all__ = ["DIALECT", "OpenAIResponses", "ResponseAccumulator", "ResponseRenderer"]

_STATUS: Final[Mapping[FinishReason, str]] = {
    FinishReason.STOP: "completed",
    FinishReason.TOOL_CALLS: "completed",
    FinishReason.LENGTH: "incomplete",
}
_INCOMPLETE: Final = {"reason": "max_output_tokens"}  # decision 4


def _response_error_code(status: int) -> str:
    """Decision 5: one of the codes the SDK's ``ResponseError`` names."""
    if status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if status < 500 else "server_error"


def _usage(usage: Usage) -> dict[str, object]:
    """Decision 6."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class _Item:
    """One output item: a message's text, or a function call's id, name and arguments."""

    __slots__ = ("call_id", "id", "name", "parts", "status")

    def __init__(self, id: str, call_id: str | None = None, name: str | None = None) -> None:
        self.id = id
        self.call_id = call_id
        self.name = name
        self.parts: list[str] = []
        self.status = "in_progress"

    @property
    def is_message(self) -> bool:
        return self.call_id is None

    def content_part(self) -> dict[str, object]:
        return {
            "type": "output_text",
            "annotations": [],
            "logprobs": [],
            "text": "".join(self.parts),
        }

    def payload(self) -> dict[str, object]:
        if self.is_message:
            content = [self.content_part()] if self.status != "in_progress" or self.parts else []
            return {
                "id": self.id,
                "type": "message",
                "status": self.status,
                "role": "assistant",
                "content": content,
            }
        return {
            "id": self.id,
            "type": "function_call",
            "status": self.status,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": "".join(self.parts),
        }


class _Output:
    """The output items of one response (decisions 2 and 3)."""

    __slots__ = ("_calls", "_suffix", "items")

    def __init__(self, response_id: str) -> None:
        self._suffix = response_id.removeprefix("resp_")
        self.items: list[_Item] = []
        self._calls: dict[int, _Item] = {}  # tool call index -> its item

    @property
    def open(self) -> _Item | None:
        """The item now open, if one is."""
        if self.items and self.items[-1].status == "in_progress":
            return self.items[-1]
        return None

    def add_message(self) -> _Item:
        item = _Item(f"msg_{self._suffix}_{len(self.items)}")
        self.items.append(item)
        return item

    def call(self, event: ToolCallDelta) -> _Item | None:
        """The item of ``event``'s call if an earlier fragment opened it (decision 2)."""
        item = self._calls.get(event.index)
        if item is not None and item is not self.open:
            raise ProtocolError(
                f"a fragment of tool call {event.index} after its item {item.id} was closed"
            )
        return item

    def add_call(self, event: ToolCallDelta) -> _Item:
        """A new item for the call ``event`` opens; the open item must be closed first."""
        if event.id is None or event.name is None:
            raise ProtocolError(
                f"the first fragment of tool call {event.index} carries no id or name"
            )
        item = _Item(f"fc_{self._suffix}_{len(self.items)}", event.id, event.name)
        self.items.append(item)
        self._calls[event.index] = item
        return item

    def payloads(self) -> list[dict[str, object]]:
        return [item.payload() for item in self.items]


@dataclass(frozen=True, slots=True)
class _Head:
    """What every response object of one stream repeats (decision 7)."""

    response_id: str
    model: str
    created: int
    echo: Mapping[str, object]

    def response(
        self,
        status: str,
        output: list[dict[str, object]],
        usage: Usage | None,
        *,
        error: Mapping[str, object] | None = None,
        incomplete: Mapping[str, object] | None = None,
    ) -> dict[str, object]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": self.echo.get("instructions"),
            "max_output_tokens": self.echo.get("max_output_tokens"),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.echo.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "store": False,
            "temperature": self.echo.get("temperature"),
            "text": self.echo.get("text", {"format": {"type": "text"}}),
            "tool_choice": self.echo.get("tool_choice", "auto"),
            "tools": self.echo.get("tools", []),
            "top_p": self.echo.get("top_p"),
            "truncation": "disabled",
            "usage": None if usage is None else _usage(usage),
            "metadata": {},
        }


def _head(meta: RenderMeta) -> _Head:
    echo = orjson.loads(meta.option("echo", "{}"))
    return _Head(meta.response_id, meta.model, meta.created, echo)


def _failure_body(failure: Failure) -> dict[str, object]:
    """A failed whole response: OpenAI's error body with the shared status (decision 5)."""
    return openai.error_body(
        failure.message, type=openai.error_type_for_status(failure.status), code=failure.code
    )


class ResponseRenderer:
    """Renders one response's neutral events as Responses stream events (see module doc)."""

    __slots__ = ("_delta_head", "_head", "_output", "_seq", "_terminated", "_usage")

    def __init__(self, meta: RenderMeta) -> None:
        self._head = _head(meta)
        self._output = _Output(meta.response_id)
        self._usage: Usage | None = None
        self._seq = 0
        self._terminated = False
        self._delta_head = ""  # the text delta event up to its sequence number, per item

    def render(self, event: NeutralEvent) -> list[Message]:
        """The messages of ``event``; raises ``ProtocolError`` after the terminal one."""
        if self._terminated:
            raise ProtocolError(
                f"OpenAI Responses stream: {type(event).__name__} after the terminal event"
            )
        match event:
            case TextDelta(text=text):
                out: list[Message] = []
                item = self._output.open
                if item is None or not item.is_message:
                    item = self._open_message(out)
                item.parts.append(text)
                seq = self._next()
                data = f'{self._delta_head}{seq},"delta":{orjson.dumps(text).decode()}}}'
                out.append(("response.output_text.delta", data))
                return out
            case ToolCallDelta():
                return self._tool_call(event)
            case Started(prompt_tokens=prompt_tokens):
                self._usage = Usage(prompt_tokens, 0)  # until a Usage event (decision 6)
                response = self._head.response("in_progress", [], None)
                return [
                    self._event("response.created", {"response": response}),
                    self._event("response.in_progress", {"response": response}),
                ]
            case Usage():
                self._usage = event
                return []
            case Finished(reason=FinishReason.CANCELLED) | Error():
                self._terminated = True
                return self._failed(failure_of(event))
            case Finished(reason=reason):
                self._terminated = True
                status = _STATUS[reason]
                out = self._close("incomplete" if status == "incomplete" else "completed")
                incomplete = _INCOMPLETE if status == "incomplete" else None
                response = self._head.response(
                    status, self._output.payloads(), self._usage, incomplete=incomplete
                )
                out.append(self._event(f"response.{status}", {"response": response}))
                return out
        raise TypeError(f"not a neutral event: {event!r}")

    # -- items ------------------------------------------------------------------------------

    def _open_message(self, out: list[Message]) -> _Item:
        out.extend(self._close("completed"))
        item = self._output.add_message()
        index = self._index
        out.append(self._item_event("response.output_item.added", index, item))
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        added = {"item_id": item.id, "output_index": index, "content_index": 0, "part": part}
        out.append(self._event("response.content_part.added", added))
        # The hot path (one per token): everything of a delta before its sequence number.
        self._delta_head = (
            '{"type":"response.output_text.delta",'
            f'"item_id":{orjson.dumps(item.id).decode()},"output_index":{index},'
            '"content_index":0,"logprobs":[],"sequence_number":'
        )
        return item

    def _tool_call(self, event: ToolCallDelta) -> list[Message]:
        out: list[Message] = []
        item = self._output.call(event)
        if item is None:
            out.extend(self._close("completed"))
            item = self._output.add_call(event)
            out.append(self._item_event("response.output_item.added", self._index, item))
        if event.arguments_delta:
            item.parts.append(event.arguments_delta)
            delta = {
                "item_id": item.id,
                "output_index": self._index,
                "delta": event.arguments_delta,
            }
            out.append(self._event("response.function_call_arguments.delta", delta))
        return out

    @property
    def _index(self) -> int:
        """The output index of the last item (the open one, when one is)."""
        return len(self._output.items) - 1

    def _close(self, status: str) -> list[Message]:
        """The events that close the open item, if one is, with ``status``."""
        item = self._output.open
        if item is None:
            return []
        index = self._index
        item.status = status
        out: list[Message] = []
        where = {"item_id": item.id, "output_index": index}
        if item.is_message:
            text = "".join(item.parts)
            where["content_index"] = 0
            out.append(
                self._event("response.output_text.done", {**where, "text": text, "logprobs": []})
            )
            out.append(
                self._event("response.content_part.done", {**where, "part": item.content_part()})
            )
        else:
            arguments = {**where, "arguments": "".join(item.parts)}
            out.append(self._event("response.function_call_arguments.done", arguments))
        out.append(self._item_event("response.output_item.done", index, item))
        return out

    def _failed(self, failure: Failure) -> list[Message]:
        """Decision 5: ``error``, then ``response.failed`` with the output so far."""
        error = {"code": failure.code, "message": failure.message, "param": None}
        out = [self._event("error", error)]
        item = self._output.open
        if item is not None:
            item.status = "incomplete"
        response_error = {
            "code": _response_error_code(failure.status),
            "message": failure.message,
            "type": failure.code,
        }
        status = "cancelled" if failure.cancelled else "failed"
        response = self._head.response(
            status, self._output.payloads(), self._usage, error=response_error
        )
        out.append(self._event("response.failed", {"response": response}))
        return out

    # -- messages ---------------------------------------------------------------------------

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _event(self, type: str, fields: Mapping[str, object]) -> Message:
        return type, dumps({"type": type, **fields, "sequence_number": self._next()})

    def _item_event(self, type: str, index: int, item: _Item) -> Message:
        return self._event(type, {"output_index": index, "item": item.payload()})


class ResponseAccumulator(WholeResponse):
    """Collects one response's neutral events into a whole ``response`` object."""

    __slots__ = ("_head", "_output")

    def __init__(self, meta: RenderMeta) -> None:
        super().__init__(description="OpenAI response", finish_reasons=_STATUS)
        self._head = _head(meta)
        self._output = _Output(meta.response_id)

    def result(self) -> dict[str, object]:
        """The whole ``response``; raises ``ProtocolError`` unless it finished well."""
        status = self._finished_well()
        self._close("incomplete" if status == "incomplete" else "completed")
        incomplete = _INCOMPLETE if status == "incomplete" else None
        usage = self._usage or Usage(0, 0)
        return self._head.response(status, self._output.payloads(), usage, incomplete=incomplete)

    def _started(self, event: Started) -> None:
        self._usage = Usage(event.prompt_tokens, 0)  # until a Usage event (decision 6)

    def _text(self, text: str) -> None:
        item = self._output.open
        if item is None or not item.is_message:
            self._close("completed")
            item = self._output.add_message()
        item.parts.append(text)

    def _tool_call(self, event: ToolCallDelta) -> None:
        item = self._output.call(event)
        if item is None:
            self._close("completed")
            item = self._output.add_call(event)
        item.parts.append(event.arguments_delta)

    def _close(self, status: str) -> None:
        item = self._output.open
        if item is not None:
            item.status = status

    def _failure_body(self, failure: Failure) -> dict[str, object]:
        return _failure_body(failure)


class OpenAIResponses:
    """The Responses API as an :class:`~sluice.dialects.base.ApiDialect`."""

    name: Final = "openai_responses"
    path: Final = "/v1/responses"
    response_id_prefix: Final = "resp_"
    request_model: Final = ResponsesBody
    retry_hint: Final = False  # the SDK's parser is not an EventSource

    def parse(self, payload: object, limits: RequestLimits) -> ParsedRequest:
        return parse_responses(payload, limits)

    def renderer(self, meta: RenderMeta) -> ResponseRenderer:
        return ResponseRenderer(meta)

    def whole(self, meta: RenderMeta) -> ResponseAccumulator:
        return ResponseAccumulator(meta)

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> dict[str, object]:
        return openai.error_body(
            message, type=openai.error_type_for_status(status), code=code, param=param
        )

    def headers(self, meta: RenderMeta) -> Mapping[str, str]:
        return {}


DIALECT: Final = OpenAIResponses()
"""The registry's instance."""
