"""Tool calling in the compatible request bodies: OpenAI's ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``response_format``, assistant ``tool_calls`` and ``tool`` messages,
and Anthropic's ``tools``, ``tool_choice``, ``tool_use`` and ``tool_result`` blocks, checked
and turned into the neutral values of :mod:`sluice.backends.base`.

JSON the client wrote is kept as JSON text (call arguments as sent, schemas as the compact
text of what they parsed to), so a proxy passes on the same values. Bounds: at most
:data:`~sluice.backends.base.MAX_TOOLS` tools per request and
:data:`~sluice.backends.base.MAX_TOOL_CALLS` calls per message; their size is bounded by
the body limit.

Anthropic to neutral (the shape an OpenAI-compatible upstream is sent), decisions:

1. ``tools[]`` ``{name, description, input_schema}`` become functions with ``input_schema``
   as ``parameters``; Anthropic's server tools (a ``type`` other than ``custom``) get a 400.
2. ``tool_choice`` ``auto``/``any``/``tool``/``none`` become ``auto``/``required``/the named
   function/``none``; ``disable_parallel_tool_use: true`` becomes
   ``parallel_tool_calls: false``.
3. An assistant message's ``tool_use`` blocks become its tool calls (``input`` as compact
   JSON arguments), its text blocks its content.
4. A user message's ``tool_result`` blocks become ``tool`` messages (one per block, in
   order, answering ``tool_use_id``), followed by a user message with its text blocks, if
   any: OpenAI wants the tool messages right after the assistant's calls. ``is_error``
   has no OpenAI equivalent and is not sent on.
"""

from __future__ import annotations

from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from sluice.backends.base import (
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    ChatMessage,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from sluice.errors import InvalidParameterError

__all__ = [
    "AnthropicMessage",
    "AnthropicTextBlock",
    "AnthropicTool",
    "AnthropicToolChoice",
    "AnthropicTools",
    "OpenAITool",
    "OpenAIToolCall",
    "OpenAIToolCalls",
    "OpenAIToolChoice",
    "OpenAITools",
    "ResponseFormatBody",
    "anthropic_messages",
    "anthropic_tool_choice",
    "anthropic_tools",
    "openai_response_format",
    "openai_tool_calls",
    "openai_tool_choice",
    "openai_tools",
]

# Names of tools and ids of calls: both APIs allow 64 characters; some servers more.
_Name = Annotated[str, Field(min_length=1, max_length=256)]
_Id = Annotated[str, Field(min_length=1, max_length=256)]
# A JSON object the client wrote (a schema, a call's input), passed on as it came.
_JsonObject = dict[str, object]


def _invalid(param: str, message: str) -> InvalidParameterError:
    return InvalidParameterError(f"{param}: {message}", param)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _json(value: _JsonObject, param: str) -> str:
    """``value`` as JSON text. The body was parsed to 1,024 levels of nesting, but orjson
    writes at most 254: a deeper schema or input is refused naming ``param``."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError as exc:
        raise _invalid(param, f"JSON nested too deeply ({exc})") from exc


# -- OpenAI ------------------------------------------------------------------------------


class _FunctionDefinition(_Lenient):
    name: _Name
    description: str | None = None
    parameters: _JsonObject | None = None
    strict: bool | None = None


class OpenAITool(_Lenient):
    type: Literal["function"]
    function: _FunctionDefinition


class _FunctionName(_Lenient):
    name: _Name


class _NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: _FunctionName


OpenAIToolChoice = Literal["none", "auto", "required"] | _NamedToolChoice


class _CalledFunction(_Lenient):
    name: _Name
    arguments: str


class OpenAIToolCall(_Lenient):
    id: _Id
    type: Literal["function"] = "function"
    function: _CalledFunction


class ResponseFormatBody(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonObject | None = None


OpenAITools = Annotated[list[OpenAITool], Field(max_length=MAX_TOOLS)]
OpenAIToolCalls = Annotated[list[OpenAIToolCall], Field(max_length=MAX_TOOL_CALLS)]


def openai_tools(tools: list[OpenAITool] | None) -> tuple[Tool, ...]:
    if not tools:
        return ()
    converted = []
    for index, tool in enumerate(tools):
        function = tool.function
        parameters = function.parameters
        where = f"tools.{index}.function.parameters"
        schema = None if parameters is None else _json(parameters, where)
        converted.append(Tool(function.name, function.description, schema, function.strict))
    return tuple(converted)


def openai_tool_choice(choice: OpenAIToolChoice | None) -> ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, str):
        return ToolChoice(ToolChoiceMode(choice))
    return ToolChoice(ToolChoiceMode.FUNCTION, choice.function.name)


def openai_tool_calls(calls: list[OpenAIToolCall] | None) -> tuple[ToolCall, ...]:
    if not calls:
        return ()
    return tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in calls)


def openai_response_format(body: ResponseFormatBody | None) -> ResponseFormat | None:
    if body is None:
        return None
    if body.type != "json_schema":
        return ResponseFormat(body.type)
    if body.json_schema is None:
        raise _invalid("response_format.json_schema", 'required when type is "json_schema"')
    return ResponseFormat("json_schema", _json(body.json_schema, "response_format.json_schema"))


# -- Anthropic ---------------------------------------------------------------------------


class AnthropicTool(_Lenient):
    name: _Name
    description: str | None = None
    input_schema: _JsonObject
    type: Literal["custom"] | None = None  # decision 1: server tools are refused


class AnthropicToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: _Name | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicTextBlock(_Lenient):
    type: Literal["text"]
    text: str


class _ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: _Id
    name: _Name
    input: _JsonObject


class _ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: _Id
    content: str | list[AnthropicTextBlock] | None = None
    is_error: bool | None = None  # decision 4: not sent on


_ContentBlock = Annotated[
    AnthropicTextBlock | _ToolUseBlock | _ToolResultBlock, Field(discriminator="type")
]


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[_ContentBlock]


AnthropicTools = Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)]


def anthropic_tools(tools: list[AnthropicTool] | None) -> tuple[Tool, ...]:
    if not tools:
        return ()
    return tuple(
        Tool(t.name, t.description, _json(t.input_schema, f"tools.{i}.input_schema"))
        for i, t in enumerate(tools)
    )


_ANTHROPIC_CHOICE_MODES = {
    "auto": ToolChoiceMode.AUTO,
    "any": ToolChoiceMode.REQUIRED,
    "none": ToolChoiceMode.NONE,
}


def anthropic_tool_choice(
    choice: AnthropicToolChoice | None,
) -> tuple[ToolChoice | None, bool | None]:
    """Decision 2: the neutral choice and ``parallel_tool_calls``."""
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if choice.name is None:
            raise _invalid("tool_choice.name", 'required when type is "tool"')
        return ToolChoice(ToolChoiceMode.FUNCTION, choice.name), parallel
    return ToolChoice(_ANTHROPIC_CHOICE_MODES[choice.type]), parallel


def _text_of(content: str | list[AnthropicTextBlock] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(block.text for block in content)


def anthropic_messages(messages: list[AnthropicMessage]) -> list[ChatMessage]:
    """Decisions 3 and 4: Anthropic messages as neutral ones."""
    chat: list[ChatMessage] = []
    for index, message in enumerate(messages):
        if isinstance(message.content, str):
            chat.append(ChatMessage(message.role, message.content))
            continue
        texts: list[str] = []
        calls: list[ToolCall] = []
        results: list[ChatMessage] = []
        for number, block in enumerate(message.content):
            where = f"messages.{index}.content.{number}"
            if isinstance(block, AnthropicTextBlock):
                texts.append(block.text)
            elif isinstance(block, _ToolUseBlock):
                if message.role != "assistant":
                    raise _invalid(where, "a tool_use block belongs to an assistant message")
                calls.append(ToolCall(block.id, block.name, _json(block.input, f"{where}.input")))
            else:
                if message.role != "user":
                    raise _invalid(where, "a tool_result block belongs to a user message")
                results.append(
                    ChatMessage("tool", _text_of(block.content), tool_call_id=block.tool_use_id)
                )
        if len(calls) > MAX_TOOL_CALLS:
            raise _invalid(
                f"messages.{index}.content",
                f"at most {MAX_TOOL_CALLS} tool_use blocks, got {len(calls)}",
            )
        chat.extend(results)
        if texts or calls or not results:
            chat.append(ChatMessage(message.role, "".join(texts), tuple(calls)))
    return chat
