"""The request body of ``POST /v1/responses`` (the OpenAI Responses API), parsed into a
:class:`~sluice.dialects.base.ParsedRequest`.

What is honoured: ``model`` (else the server's default), ``instructions`` (a system
message before the input), ``input`` as a string (one user message) or a list of input
items, ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, function ``tools``,
``tool_choice``, ``parallel_tool_calls`` and ``text.format``, plus Sluice's
``ignore_eos`` and ``speculative`` (as for the other dialects). Fields that change nothing here (``store``,
``metadata``, ``user``, ``reasoning``, ``include``, ``stream_options``, ...) are ignored, as
other OpenAI-compatible servers do. Refused with a 400 naming the field, decisions:

1. Input items: ``message`` items (``role`` ``user``, ``system``, ``developer`` (as
   ``system``) or ``assistant``; ``content`` a string or ``input_text``/``output_text``/
   ``refusal`` parts), ``function_call`` and ``function_call_output`` items. Image, file
   and audio parts and every other item type (``reasoning``, ``item_reference``, hosted
   tool calls) get a 400 naming ``input.<i>...``: Sluice serves text models and stores
   no items to refer to.
2. Tools: ``{"type": "function", "name", "description", "parameters", "strict"}`` maps
   one to one onto the neutral :class:`~sluice.backends.base.Tool` (the chat API's
   function, flattened), so an upstream gets them as chat tools and a backend that cannot
   call tools refuses them with its own 400; hosted tools (``web_search``,
   ``file_search``, ``mcp``, ``custom``, ...) get a 400 naming ``tools.<i>.type``.
   ``tool_choice`` ``none``/``auto``/``required``/``{"type": "function", "name"}`` map as
   the chat API's do; other choices get a 400.
3. Consecutive ``function_call`` items are one assistant message's calls (joined to the
   assistant message right before them, if there is one), and each
   ``function_call_output`` a ``tool`` message answering ``call_id``: the shape of a chat
   history. A call output's content parts must be text.
4. ``text.format`` ``json_schema`` becomes the chat API's ``response_format`` (``name``,
   ``schema``, ``strict``, ``description``), ``json_object`` and ``text`` likewise.
5. Sluice keeps no responses: ``previous_response_id``, ``conversation``, ``prompt``
   (stored prompt templates) and ``background: true`` get a 400.
"""

from __future__ import annotations

from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sluice.backends.base import (
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    ChatMessage,
    GenerationRequest,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from sluice.dialects.base import ParsedRequest, RequestLimits
from sluice.errors import InvalidParameterError

__all__ = ["ResponsesBody", "parse_responses"]

# Names of tools and ids of calls: OpenAI allows 64 characters; some servers more.
_Name = Annotated[str, Field(min_length=1, max_length=256)]
_MAX_ITEMS = 1024  # input items, as many as the chat API's messages
_MAX_PARTS = 1024  # content parts of one item


class _Lenient(BaseModel):
    """Unknown fields are ignored (clients send many); known ones are checked."""

    model_config = ConfigDict(extra="ignore")


class _Part(_Lenient):
    """A content part; which types are honoured is decided in :func:`_part_text`."""

    type: str
    text: str | None = None
    refusal: str | None = None


_Content = str | Annotated[list[_Part], Field(max_length=_MAX_PARTS)]


class _Item(_Lenient):
    """An input item; which fields it needs is decided by its type (decision 1)."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: _Content | None = None
    call_id: _Name | None = None
    name: _Name | None = None
    arguments: str | None = None
    output: _Content | None = None


class _ToolBody(_Lenient):
    type: str
    name: _Name | None = None
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class _ToolChoiceBody(_Lenient):
    type: str
    name: _Name | None = None


class _TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: _Name | None = None
    json_schema: dict[str, object] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class _TextConfig(_Lenient):
    format: _TextFormat | None = None


class ResponsesBody(_Lenient):
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    input: str | Annotated[list[_Item], Field(min_length=1, max_length=_MAX_ITEMS)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    tools: Annotated[list[_ToolBody], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | _ToolChoiceBody | None = None
    parallel_tool_calls: bool | None = None
    text: _TextConfig | None = None
    ignore_eos: bool = False  # vLLM's extension, as for the other dialects
    speculative: bool = True  # ours: false opts out of speculative decoding
    # Decision 5: refused when set.
    previous_response_id: object = None
    conversation: object = None
    prompt: object = None
    background: bool | None = None


def _invalid(param: str, message: str) -> InvalidParameterError:
    return InvalidParameterError(f"{param}: {message}", param)


def _validate(payload: object) -> ResponsesBody:
    if not isinstance(payload, dict):
        raise InvalidParameterError("request body must be a JSON object")
    try:
        return ResponsesBody.model_validate(payload)
    except ValidationError as exc:
        parts = []
        param, depth = "body", -1
        for error in exc.errors(include_url=False):
            loc = [part for part in error["loc"] if not _is_union_tag(part)]
            where = ".".join(str(part) for part in loc) or "body"
            if len(loc) > depth:  # the deepest: a union's other members fail at its top
                param, depth = where, len(loc)
            parts.append(f"{where}: {error['msg']}")
        raise InvalidParameterError("; ".join(parts), param) from exc


def _is_union_tag(part: str | int) -> bool:
    """Whether a part of an error's location names a member of a union (``str``,
    ``list[_Part]``, ``_ToolChoiceBody``, ``literal[...]``) rather than a field: the
    client's field path leaves them out (``input.0.role``, not ``input.list[_Item].0.role``).
    No field here is named ``str`` or starts with ``_``."""
    return isinstance(part, str) and (part == "str" or "[" in part or part.startswith("_"))


def _json(value: dict[str, object], param: str) -> str:
    """``value`` as compact JSON text; orjson writes at most 254 levels of nesting."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError as exc:
        raise _invalid(param, f"JSON nested too deeply ({exc})") from exc


_TEXT_PARTS = frozenset({"input_text", "output_text"})


def _part_text(part: _Part, where: str) -> str:
    if part.type in _TEXT_PARTS and part.text is not None:
        return part.text
    if part.type == "refusal" and part.refusal is not None:
        return part.refusal
    if part.type in _TEXT_PARTS or part.type == "refusal":
        raise _invalid(where, f"a {part.type} part needs its text")
    raise _invalid(f"{where}.type", f"{part.type!r} parts are not supported; send text parts")


def _text(content: _Content | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(_part_text(part, f"{where}.{i}") for i, part in enumerate(content))


def _messages(body: ResponsesBody) -> list[ChatMessage]:
    """Decisions 1 and 3: the input as a chat history."""
    messages: list[ChatMessage] = []
    if body.instructions is not None:
        messages.append(ChatMessage("system", body.instructions))
    if isinstance(body.input, str):
        messages.append(ChatMessage("user", body.input))
        return messages
    for index, item in enumerate(body.input):
        where = f"input.{index}"
        if item.type == "message":
            if item.role is None:
                raise _invalid(f"{where}.role", "a message needs a role")
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role, _text(item.content, f"{where}.content")))
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise _invalid(where, "a function_call needs call_id, name and arguments")
            call = ToolCall(item.call_id, item.name, item.arguments)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                if len(last.tool_calls) >= MAX_TOOL_CALLS:
                    raise _invalid(where, f"at most {MAX_TOOL_CALLS} calls in a row")
                messages[-1] = ChatMessage("assistant", last.content, (*last.tool_calls, call))
            else:
                messages.append(ChatMessage("assistant", "", (call,)))
        elif item.type == "function_call_output":
            if item.call_id is None:
                raise _invalid(f"{where}.call_id", "a function_call_output needs its call_id")
            output = _text(item.output, f"{where}.output")
            messages.append(ChatMessage("tool", output, tool_call_id=item.call_id))
        else:
            raise _invalid(
                f"{where}.type",
                f"{item.type!r} items are not supported; send message, function_call and "
                "function_call_output items",
            )
    return messages


def _tools(body: ResponsesBody) -> tuple[Tool, ...]:
    """Decision 2."""
    tools = []
    for index, tool in enumerate(body.tools or ()):
        where = f"tools.{index}"
        if tool.type != "function":
            raise _invalid(
                f"{where}.type", f"{tool.type!r} tools are not supported; send functions"
            )
        if tool.name is None:
            raise _invalid(f"{where}.name", "a function tool needs a name")
        schema = None if tool.parameters is None else _json(tool.parameters, f"{where}.parameters")
        tools.append(Tool(tool.name, tool.description, schema, tool.strict))
    return tuple(tools)


def _tool_choice(choice: str | _ToolChoiceBody | None) -> ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, str):
        return ToolChoice(ToolChoiceMode(choice))
    if choice.type != "function":
        raise _invalid("tool_choice.type", f"{choice.type!r} is not supported; name a function")
    if choice.name is None:
        raise _invalid("tool_choice.name", 'required when type is "function"')
    return ToolChoice(ToolChoiceMode.FUNCTION, choice.name)


def _response_format(text: _TextConfig | None) -> ResponseFormat | None:
    """Decision 4."""
    format = None if text is None else text.format
    if format is None:
        return None
    if format.type != "json_schema":
        return ResponseFormat(format.type)
    if format.name is None or format.json_schema is None:
        raise _invalid("text.format", 'a "json_schema" format needs a name and a schema')
    schema: dict[str, object] = {"name": format.name, "schema": format.json_schema}
    if format.description is not None:
        schema["description"] = format.description
    if format.strict is not None:
        schema["strict"] = format.strict
    return ResponseFormat("json_schema", _json(schema, "text.format.schema"))


def _refuse_stored(body: ResponsesBody) -> None:
    """Decision 5."""
    for field in ("previous_response_id", "conversation", "prompt"):
        if getattr(body, field) is not None:
            raise _invalid(field, "Sluice stores no responses; send the whole input")
    if body.background:
        raise _invalid("background", "background responses are not supported; stream instead")


def _echo(body: ResponsesBody, tools: tuple[Tool, ...]) -> str:
    """What the response object repeats of the request (the renderer's decision 7)."""
    echo: dict[str, object] = {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
    }
    if tools:
        echo["tools"] = [
            {
                "type": "function",
                "name": tool.name,
                "description": tool.description,
                "parameters": None if tool.parameters is None else orjson.loads(tool.parameters),
                "strict": tool.strict,
            }
            for tool in tools
        ]
    if body.tool_choice is not None:
        choice = body.tool_choice
        echo["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "name": choice.name}
        )
    if body.text is not None and body.text.format is not None:
        echo["text"] = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
    return orjson.dumps(echo).decode()


def parse_responses(payload: object, limits: RequestLimits) -> ParsedRequest:
    """A ``POST /v1/responses`` body; raises ``InvalidParameterError`` (a 400 naming the
    field) for one it refuses."""
    body = _validate(payload)
    _refuse_stored(body)
    messages = _messages(body)
    chars = sum(len(message.content) for message in messages)
    if chars > limits.max_prompt_chars:
        raise _invalid(
            "input", f"{chars} characters is over the limit of {limits.max_prompt_chars}"
        )
    if body.max_output_tokens is not None and body.max_output_tokens > limits.max_tokens_limit:
        raise _invalid(
            "max_output_tokens",
            f"must be at most {limits.max_tokens_limit}, got {body.max_output_tokens}",
        )
    tools = _tools(body)
    generation = GenerationRequest(
        prompt="",
        messages=tuple(messages),
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        ignore_eos=body.ignore_eos,
        speculative=body.speculative,
        tools=tools,
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
    )
    return ParsedRequest(
        model=body.model or limits.default_model,
        generation=generation,
        stream=body.stream,
        include_usage=True,
        options=(("echo", _echo(body, tools)),),
    )
