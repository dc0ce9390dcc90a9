"""The Vercel AI SDK UI message stream: what ``useChat`` (AI SDK 5 and 6) reads, at
``POST /v1/ui/chat``.

Pure: events in, ``(None, JSON data)`` messages out: unnamed SSE ``data:`` frames, each one
UI message chunk (the ``ai`` package's ``uiMessageChunkSchema``); responses carry the
header ``x-vercel-ai-ui-message-stream: v1``. The request is the body ``useChat``'s
``DefaultChatTransport`` sends: ``{"id", "messages": [UIMessage], "trigger", "messageId"}``
plus what the app adds through ``body`` (see :func:`parse_ui_chat`).

=====================  ===============================================================
neutral event          UI message chunks
=====================  ===============================================================
Started                ``start`` (``messageId``), ``start-step``
TextDelta              [close the open part], [``text-start``], ``text-delta``
ToolCallDelta (first)  [close the open part], ``tool-input-start``,
                       [``tool-input-delta``]
ToolCallDelta (later)  ``tool-input-delta`` when non-empty
Usage                  nothing (kept for ``finish``)
Finished(stop|...)     [close the open part], ``finish-step``, ``finish``, ``[DONE]``
Finished(cancelled)    ``error`` (``errorText``); no ``[DONE]``
Error                  ``error`` (``errorText``); no ``[DONE]``
=====================  ===============================================================

Closing a text part is ``text-end``; closing a tool call is ``tool-input-available`` with
its arguments parsed as JSON, or ``tool-input-error`` when they do not parse. Decisions:

1. Parts are sequential, as ``streamText`` writes them: a part is closed before the next
   opens, so a fragment for a call already closed raises
   :class:`~sluice.errors.ProtocolError`, as does a first fragment without ``id`` and
   ``name``. Text part ids are ``text-<n>`` (n counts the parts from 0); tool parts use the
   neutral call id.
2. ``finishReason`` is ``stop``, ``length`` or ``tool-calls``; ``finish`` carries
   ``messageMetadata.usage`` (``inputTokens``, ``outputTokens``, ``totalTokens``), which
   ``useChat`` merges into the message's ``metadata``.
3. A stream that ended badly (an ``Error``, or a cancel, which the shared failure table of
   :mod:`sluice.dialects.common` treats as one) sends one ``error`` chunk with the message,
   and nothing after it. Divergence: the AI SDK's own servers close every stream with
   ``[DONE]``, errors too; here ``[DONE]`` is only sent after ``finish`` (the rule of every
   Sluice dialect: no success terminator after an error). The SDK's parser ignores
   ``[DONE]``, so clients see no difference.
4. Errors before a stream starts have OpenAI's body (``{"error": {...}}``) with the
   shared statuses; ``useChat`` raises an ``Error`` whose message is that body's text.
5. The model is the body's ``model``, else the server's default; ``system`` (a string) is
   a system message before the history. Message parts: ``text`` parts are the content;
   ``reasoning``, ``step-start``, ``source-*`` and ``data-*`` parts are dropped (as the AI
   SDK's ``convertToModelMessages`` drops data parts); ``file`` and tool parts get a 400
   naming the part: Sluice serves text models, and this endpoint takes no tool
   definitions to continue a history of tool calls with.
6. Rendering after the terminal event raises ``ProtocolError`` (as h11 does).
7. ``useChat`` always streams; a body with ``"stream": false`` (Sluice's extension, for a
   server that renders before it answers) gets the assistant's whole ``UIMessage``, its
   ``metadata`` holding ``finishReason`` and ``usage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Final, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sluice.backends.base import ChatMessage, GenerationRequest
from sluice.dialects import openai
from sluice.dialects.base import Message, ParsedRequest, RequestLimits
from sluice.dialects.common import Failure, WholeResponse, dumps, failure_of
from sluice.errors import InvalidParameterError, ProtocolError
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

__all__ = [
    "DIALECT",
    "HEADERS",
    "UIAccumulator",
    "UIChatBody",
    "UIChunkRenderer",
    "VercelUI",
    "parse_ui_chat",
]

HEADERS: Final[Mapping[str, str]] = {"x-vercel-ai-ui-message-stream": "v1"}
"""The response header that names the protocol (the ``ai`` package's own)."""

DONE: Final = "[DONE]"

_FINISH_REASON: Final[Mapping[FinishReason, str]] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TOOL_CALLS: "tool-calls",
}
_DROPPED_PARTS: Final = frozenset({"reasoning", "step-start", "source-url", "source-document"})
_MAX_MESSAGES: Final = 1024  # as many as the chat API's messages
_MAX_PARTS: Final = 1024  # parts of one message


# -- the request ---------------------------------------------------------------------------


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Part(_Lenient):
    type: str
    text: str | None = None


class _UIMessage(_Lenient):
    id: str | None = None
    role: Literal["system", "user", "assistant"]
    parts: Annotated[list[_Part], Field(max_length=_MAX_PARTS)]


class UIChatBody(_Lenient):
    """``id``, ``trigger`` and ``messageId`` change nothing here: a regenerate request's
    ``messages`` already end before the message it replaces."""

    messages: Annotated[list[_UIMessage], Field(min_length=1, max_length=_MAX_MESSAGES)]
    # What an app adds with ``body`` (decision 5).
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    system: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    ignore_eos: bool = False  # vLLM's extension, as for the other dialects
    speculative: bool = True  # ours: false opts out of speculative decoding
    stream: bool = True  # decision 7


def _invalid(param: str, message: str) -> InvalidParameterError:
    return InvalidParameterError(f"{param}: {message}", param)


def _validate(payload: object) -> UIChatBody:
    if not isinstance(payload, dict):
        raise InvalidParameterError("request body must be a JSON object")
    try:
        return UIChatBody.model_validate(payload)
    except ValidationError as exc:
        parts = []
        param: str | None = None
        for error in exc.errors(include_url=False):
            where = ".".join(str(part) for part in error["loc"]) or "body"
            param = param or where
            parts.append(f"{where}: {error['msg']}")
        raise InvalidParameterError("; ".join(parts), param) from exc


def _content(message: _UIMessage, index: int) -> str:
    """Decision 5: a message's text parts, joined."""
    texts = []
    for number, part in enumerate(message.parts):
        where = f"messages.{index}.parts.{number}"
        if part.type == "text":
            if part.text is None:
                raise _invalid(f"{where}.text", "a text part needs its text")
            texts.append(part.text)
        elif part.type in _DROPPED_PARTS or part.type.startswith("data-"):
            continue
        elif part.type == "file":
            raise _invalid(f"{where}.type", "file parts are not supported; send text parts")
        else:
            raise _invalid(
                f"{where}.type",
                f"{part.type!r} parts are not supported: this endpoint takes no tools",
            )
    return "".join(texts)


def parse_ui_chat(payload: object, limits: RequestLimits) -> ParsedRequest:
    """A ``useChat`` request body; raises ``InvalidParameterError`` (a 400 naming the
    field) for one it refuses."""
    body = _validate(payload)
    messages = [ChatMessage(m.role, _content(m, i)) for i, m in enumerate(body.messages)]
    if body.system is not None:
        messages.insert(0, ChatMessage("system", body.system))
    chars = sum(len(message.content) for message in messages)
    if chars > limits.max_prompt_chars:
        raise _invalid(
            "messages", f"{chars} characters is over the limit of {limits.max_prompt_chars}"
        )
    if body.max_tokens is not None and body.max_tokens > limits.max_tokens_limit:
        raise _invalid(
            "max_tokens", f"must be at most {limits.max_tokens_limit}, got {body.max_tokens}"
        )
    generation = GenerationRequest(
        prompt="",
        messages=tuple(messages),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        speculative=body.speculative,
    )
    return ParsedRequest(body.model or limits.default_model, generation, stream=body.stream)


# -- the stream ----------------------------------------------------------------------------


def _usage(usage: Usage | None) -> dict[str, object]:
    """Decision 2."""
    if usage is None:
        usage = Usage(0, 0)
    return {
        "inputTokens": usage.prompt_tokens,
        "outputTokens": usage.completion_tokens,
        "totalTokens": usage.prompt_tokens + usage.completion_tokens,
    }


class _Call:
    __slots__ = ("arguments", "id", "name")

    def __init__(self, id: str, name: str) -> None:
        self.id = id
        self.name = name
        self.arguments: list[str] = []

    def done(self) -> dict[str, object]:
        """``tool-input-available`` with the parsed input, or ``tool-input-error``."""
        text = "".join(self.arguments)
        head = {"toolCallId": self.id, "toolName": self.name}
        try:
            value = orjson.loads(text) if text.strip() else {}
        except orjson.JSONDecodeError:
            error = "the tool call's arguments are not JSON"
            return {"type": "tool-input-error", **head, "input": text, "errorText": error}
        return {"type": "tool-input-available", **head, "input": value}


def _first_fragment(event: ToolCallDelta) -> _Call:
    if event.id is None or event.name is None:
        raise ProtocolError(f"the first fragment of tool call {event.index} carries no id or name")
    return _Call(event.id, event.name)


class UIChunkRenderer:
    """Renders one response's neutral events as UI message chunks (see module doc)."""

    __slots__ = (
        "_calls",
        "_delta_head",
        "_message_id",
        "_num_parts",
        "_open",
        "_terminated",
        "_usage",
    )

    def __init__(self, meta: RenderMeta) -> None:
        self._message_id = meta.response_id
        self._usage: Usage | None = None
        self._num_parts = 0
        self._open: _Call | str | None = None  # the open part: a call, or a text part's id
        self._calls: dict[int, _Call] = {}  # tool call index -> its call
        self._terminated = False
        self._delta_head = ""  # a text-delta chunk up to its delta, for the open text part

    def render(self, event: NeutralEvent) -> list[Message]:
        """The messages of ``event``; raises ``ProtocolError`` after the terminal one."""
        if self._terminated:
            raise ProtocolError(
                f"Vercel UI message stream: {type(event).__name__} after the terminal event"
            )
        match event:
            case TextDelta(text=text):
                out = [] if isinstance(self._open, str) else self._open_text()
                out.append((None, f"{self._delta_head}{orjson.dumps(text).decode()}}}"))
                return out
            case ToolCallDelta():
                return self._tool_call(event)
            case Started():
                start = {"type": "start", "messageId": self._message_id}
                return [(None, dumps(start)), (None, '{"type":"start-step"}')]
            case Usage():
                self._usage = event
                return []
            case Finished(reason=FinishReason.CANCELLED) | Error():
                self._terminated = True
                error = {"type": "error", "errorText": failure_of(event).message}
                return [(None, dumps(error))]
            case Finished(reason=reason):
                self._terminated = True
                out = self._close()
                finish = {
                    "type": "finish",
                    "finishReason": _FINISH_REASON[reason],
                    "messageMetadata": {"usage": _usage(self._usage)},
                }
                out.extend([(None, '{"type":"finish-step"}'), (None, dumps(finish)), (None, DONE)])
                return out
        raise TypeError(f"not a neutral event: {event!r}")

    def _open_text(self) -> list[Message]:
        out = self._close()
        part_id = f"text-{self._num_parts}"
        self._num_parts += 1
        self._open = part_id
        out.append((None, dumps({"type": "text-start", "id": part_id})))
        # The hot path (one per token): the chunk up to its delta's JSON string.
        self._delta_head = f'{{"type":"text-delta","id":"{part_id}","delta":'
        return out

    def _tool_call(self, event: ToolCallDelta) -> list[Message]:
        call = self._calls.get(event.index)
        out: list[Message] = []
        if call is None:
            out = self._close()
            call = _first_fragment(event)
            self._calls[event.index] = call
            self._num_parts += 1
            self._open = call
            out.append(
                (
                    None,
                    dumps(
                        {"type": "tool-input-start", "toolCallId": call.id, "toolName": call.name}
                    ),
                )
            )
        elif call is not self._open:
            raise ProtocolError(f"a fragment of tool call {event.index} after its part was closed")
        if event.arguments_delta:
            call.arguments.append(event.arguments_delta)
            delta = {
                "type": "tool-input-delta",
                "toolCallId": call.id,
                "inputTextDelta": event.arguments_delta,
            }
            out.append((None, dumps(delta)))
        return out

    def _close(self) -> list[Message]:
        """The chunk that closes the open part, if one is."""
        part, self._open = self._open, None
        if part is None:
            return []
        if isinstance(part, str):
            return [(None, dumps({"type": "text-end", "id": part}))]
        return [(None, dumps(part.done()))]


class _Text:
    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[str] = []


class UIAccumulator(WholeResponse):
    """A ``"stream": false`` answer: the assistant's ``UIMessage`` (decision 7)."""

    __slots__ = ("_calls", "_message_id", "_parts")

    def __init__(self, meta: RenderMeta) -> None:
        super().__init__(description="Vercel UI message", finish_reasons=_FINISH_REASON)
        self._message_id = meta.response_id
        self._parts: list[_Text | _Call] = []
        self._calls: dict[int, _Call] = {}

    def result(self) -> dict[str, object]:
        """The whole message; raises ``ProtocolError`` unless it finished well."""
        finish_reason = self._finished_well()
        parts: list[dict[str, object]] = []
        for part in self._parts:
            if isinstance(part, _Text):
                parts.append({"type": "text", "text": "".join(part.parts), "state": "done"})
                continue
            done = part.done()
            tool: dict[str, object] = {
                "type": f"tool-{part.name}",
                "toolCallId": part.id,
                "state": "input-available",
                "input": done["input"],
            }
            if done["type"] == "tool-input-error":
                tool["state"] = "output-error"
                tool["errorText"] = done["errorText"]
            parts.append(tool)
        metadata = {"finishReason": finish_reason, "usage": _usage(self._usage)}
        return {"id": self._message_id, "role": "assistant", "parts": parts, "metadata": metadata}

    def _text(self, text: str) -> None:
        last = self._parts[-1] if self._parts else None
        if not isinstance(last, _Text):
            last = _Text()
            self._parts.append(last)
        last.parts.append(text)

    def _tool_call(self, event: ToolCallDelta) -> None:
        call = self._calls.get(event.index)
        if call is None:
            call = _first_fragment(event)
            self._calls[event.index] = call
            self._parts.append(call)
        elif call is not self._parts[-1]:
            raise ProtocolError(f"a fragment of tool call {event.index} after its part was closed")
        call.arguments.append(event.arguments_delta)

    def _failure_body(self, failure: Failure) -> dict[str, object]:
        return openai.error_body(
            failure.message, type=openai.error_type_for_status(failure.status), code=failure.code
        )


class VercelUI:
    """The UI message stream as an :class:`~sluice.dialects.base.ApiDialect`."""

    name: Final = "vercel_ui"
    path: Final = "/v1/ui/chat"
    response_id_prefix: Final = "uimsg_"
    request_model: Final = UIChatBody
    retry_hint: Final = False  # as the AI SDK's own servers

    def parse(self, payload: object, limits: RequestLimits) -> ParsedRequest:
        return parse_ui_chat(payload, limits)

    def renderer(self, meta: RenderMeta) -> UIChunkRenderer:
        return UIChunkRenderer(meta)

    def whole(self, meta: RenderMeta) -> UIAccumulator:
        return UIAccumulator(meta)

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> dict[str, object]:
        return openai.error_body(
            message, type=openai.error_type_for_status(status), code=code, param=param
        )

    def headers(self, meta: RenderMeta) -> Mapping[str, str]:
        return HEADERS


DIALECT: Final = VercelUI()
"""The registry's instance."""
