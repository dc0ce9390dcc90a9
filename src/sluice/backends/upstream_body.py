"""The body of a streamed request to an OpenAI-compatible upstream, from a
:class:`~sluice.backends.base.GenerationRequest` (pure: a request in, JSON bytes out).

A chat request becomes ``POST /chat/completions`` with ``messages``, a text request
``POST /completions`` with ``prompt``; both ask for ``stream: true`` and the usage chunk.
Sampling fields go only when set. Tool calling goes in OpenAI's own shape, whichever
dialect the client spoke (an Anthropic request was turned into these values already, see
:mod:`sluice.dialects.tools`):

- ``tools`` as ``{"type": "function", "function": {name, description?, parameters?,
  strict?}}``; ``tool_choice`` as ``"auto"``/``"none"``/``"required"`` or
  ``{"type": "function", "function": {"name"}}``; ``parallel_tool_calls`` and
  ``response_format`` when given;
- an assistant message's calls as ``tool_calls`` (``content`` ``null`` when it has no
  text, as OpenAI writes it), a ``tool`` message's ``tool_call_id``.

JSON the client wrote (schemas, arguments) is carried as JSON text and embedded as that
text (:class:`orjson.Fragment`), never parsed again, so the upstream receives the same
values.
"""

from __future__ import annotations

import orjson

from sluice.backends.base import ChatMessage, GenerationRequest, Tool, ToolChoice, ToolChoiceMode

__all__ = ["request_body"]

# Sent when set; top_k is not OpenAI's, but vLLM and llama.cpp accept it.
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "top_k")


def request_body(request: GenerationRequest, upstream_model: str) -> bytes:
    """The JSON body of ``request`` for an upstream that serves ``upstream_model``."""
    body: dict[str, object] = {
        "model": upstream_model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.messages is not None:
        body["messages"] = [_message(m) for m in request.messages]
    else:
        body["prompt"] = request.prompt
    for name in _SAMPLING_FIELDS:
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.stop:
        body["stop"] = list(request.stop)
    if request.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension (and ours); sent only when asked for
    if request.tools:
        body["tools"] = [_tool(tool) for tool in request.tools]
    if request.tool_choice is not None:
        body["tool_choice"] = _tool_choice(request.tool_choice)
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    response_format = request.response_format
    if response_format is not None:
        format_body: dict[str, object] = {"type": response_format.type}
        if response_format.json_schema is not None:
            format_body["json_schema"] = orjson.Fragment(response_format.json_schema)
        body["response_format"] = format_body
    return orjson.dumps(body)


def _message(message: ChatMessage) -> dict[str, object]:
    payload: dict[str, object] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        if not message.content:
            payload["content"] = None
        payload["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        payload["tool_call_id"] = message.tool_call_id
    return payload


def _tool(tool: Tool) -> dict[str, object]:
    function: dict[str, object] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = orjson.Fragment(tool.parameters)
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> object:
    if choice.mode is ToolChoiceMode.FUNCTION:
        return {"type": "function", "function": {"name": choice.name}}
    return choice.mode.value
