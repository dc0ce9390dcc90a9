"""Request bodies of the compatible APIs: OpenAI Chat Completions and Completions, Anthropic
Messages, parsed into a :class:`~sluice.backends.base.GenerationRequest`.

OpenAI's ``user`` becomes the stream's routing key (a model alias keeps one user on one
version, :mod:`sluice.rollout.assignment`). Fields the official SDKs send that change
nothing here (``metadata``,
``frequency_penalty`` at 0, ...) are accepted and ignored, as other OpenAI-compatible
servers do; fields that would change the answer in a way Sluice cannot honour (``n`` above
1, ``echo``, ``best_of``, the legacy ``functions``) are refused with a 400 that names them.
Tool calling (:mod:`sluice.dialects.tools`) is carried to the backend, which honours
it (an upstream) or refuses it with a 400 naming the field (the engine, ``words``).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sluice.backends.base import ChatMessage, GenerationRequest
from sluice.dialects.base import ParsedRequest, RequestLimits
from sluice.dialects.tools import (
    AnthropicMessage,
    AnthropicTextBlock,
    AnthropicToolChoice,
    AnthropicTools,
    OpenAIToolCalls,
    OpenAIToolChoice,
    OpenAITools,
    ResponseFormatBody,
    anthropic_messages,
    anthropic_tool_choice,
    anthropic_tools,
    openai_response_format,
    openai_tool_calls,
    openai_tool_choice,
    openai_tools,
)
from sluice.errors import InvalidParameterError

__all__ = [
    "ChatBody",
    "CompletionBody",
    "MessagesBody",
    "parse_anthropic_messages",
    "parse_openai",
]

_Temperature = Annotated[float, Field(ge=0, le=2)]
_TopP = Annotated[float, Field(gt=0, le=1)]
_Seed = Annotated[int, Field(ge=0, lt=2**63)]
_MaxTokens = Annotated[int, Field(ge=1)]
_Stop = Annotated[str, Field(min_length=1, max_length=256)]
_Body = TypeVar("_Body", bound=BaseModel)


class _Lenient(BaseModel):
    """Unknown fields are ignored (clients send many); known ones are checked."""

    model_config = ConfigDict(extra="ignore")


class _TextPart(_Lenient):
    type: Literal["text"]
    text: str


class _StreamOptions(_Lenient):
    include_usage: bool = False


class _OpenAIMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    tool_calls: OpenAIToolCalls | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None


class _OpenAICommon(_Lenient):
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # the default
    stream: bool = False
    stream_options: _StreamOptions | None = None
    temperature: _Temperature | None = None
    top_p: _TopP | None = None
    seed: _Seed | None = None
    stop: _Stop | Annotated[list[_Stop], Field(max_length=16)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    ignore_eos: bool = False  # vLLM's extension: run all max_tokens past an end of text
    speculative: bool = True  # ours: false opts out of speculative decoding
    user: Annotated[str, Field(max_length=256)] | None = None  # the routing key


class ChatBody(_OpenAICommon):
    messages: Annotated[list[_OpenAIMessage], Field(min_length=1, max_length=1024)]
    max_tokens: _MaxTokens | None = None
    max_completion_tokens: _MaxTokens | None = None
    tools: OpenAITools | None = None
    tool_choice: OpenAIToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatBody | None = None
    # The legacy functions API: refused (a 400 naming it) rather than silently dropped.
    functions: object = None
    function_call: object = None


class CompletionBody(_OpenAICommon):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: _MaxTokens | None = 16  # the Completions API's own default
    echo: Literal[False] = False
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None


class MessagesBody(_Lenient):
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # the default
    max_tokens: _MaxTokens
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=1024)]
    system: str | list[AnthropicTextBlock] | None = None
    tools: AnthropicTools | None = None
    tool_choice: AnthropicToolChoice | None = None
    stop_sequences: Annotated[list[_Stop], Field(max_length=16)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: _TopP | None = None
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    stream: bool = False
    ignore_eos: bool = False  # as for OpenAI requests (vLLM's extension)
    speculative: bool = True  # ours, as for OpenAI requests


def _explain(exc: ValidationError) -> tuple[str, str | None]:
    """The message and the first offending parameter of a validation error."""
    parts = []
    param: str | None = None
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "body"
        param = param or where
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts), param


def _validate(model: type[_Body], payload: object) -> _Body:
    if not isinstance(payload, dict):
        raise InvalidParameterError("request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        message, param = _explain(exc)
        raise InvalidParameterError(message, param) from exc


def _text(content: str | list[_TextPart] | list[AnthropicTextBlock] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _check_chars(text: str, limits: RequestLimits, what: str) -> None:
    if len(text) > limits.max_prompt_chars:
        raise InvalidParameterError(
            f"{what}: {len(text)} characters is over the limit of {limits.max_prompt_chars}",
            what,
        )


def _check_max_tokens(max_tokens: int | None, limits: RequestLimits, param: str) -> None:
    if max_tokens is not None and max_tokens > limits.max_tokens_limit:
        raise InvalidParameterError(
            f"{param}: must be at most {limits.max_tokens_limit}, got {max_tokens}", param
        )


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _chat_message(message: _OpenAIMessage, index: int) -> ChatMessage:
    role = "system" if message.role == "developer" else message.role
    if message.tool_calls and role != "assistant":
        param = f"messages.{index}.tool_calls"
        raise InvalidParameterError(f"{param}: only an assistant message holds tool calls", param)
    tool_call_id = message.tool_call_id if role == "tool" else None
    calls = openai_tool_calls(message.tool_calls)
    return ChatMessage(role, _text(message.content), calls, tool_call_id)


def _chat(body: ChatBody, limits: RequestLimits) -> GenerationRequest:
    for legacy in ("functions", "function_call"):
        if getattr(body, legacy) is not None:
            raise InvalidParameterError(
                f"{legacy}: the legacy functions API is not supported; send tools and tool_choice",
                legacy,
            )
    messages = tuple(_chat_message(m, i) for i, m in enumerate(body.messages))
    _check_chars("".join(m.content for m in messages), limits, "messages")
    max_tokens = body.max_completion_tokens or body.max_tokens
    _check_max_tokens(max_tokens, limits, "max_tokens")
    return GenerationRequest(
        prompt="",
        messages=messages,
        max_tokens=max_tokens,
        tools=openai_tools(body.tools),
        tool_choice=openai_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=openai_response_format(body.response_format),
    )


def parse_openai(payload: object, limits: RequestLimits, *, chat: bool) -> ParsedRequest:
    """A ``POST /v1/chat/completions`` (``chat``) or ``POST /v1/completions`` body."""
    body: ChatBody | CompletionBody
    if chat:
        body = _validate(ChatBody, payload)
        generation = _chat(body, limits)
    else:
        body = _validate(CompletionBody, payload)
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        _check_chars(prompt, limits, "prompt")
        _check_max_tokens(body.max_tokens, limits, "max_tokens")
        generation = GenerationRequest(prompt=prompt, max_tokens=body.max_tokens)
    generation = dataclasses.replace(
        generation,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=_stops(body.stop),
        ignore_eos=body.ignore_eos,
        speculative=body.speculative,
        routing_key=body.user or None,
    )
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    model = body.model or limits.default_model
    return ParsedRequest(model, generation, body.stream, include_usage)


def parse_anthropic_messages(payload: object, limits: RequestLimits) -> ParsedRequest:
    """A ``POST /v1/messages`` body."""
    body = _validate(MessagesBody, payload)
    messages = anthropic_messages(body.messages)
    if body.system is not None:
        messages.insert(0, ChatMessage("system", _text(body.system)))
    _check_chars("".join(m.content for m in messages), limits, "messages")
    _check_max_tokens(body.max_tokens, limits, "max_tokens")
    tool_choice, parallel_tool_calls = anthropic_tool_choice(body.tool_choice)
    generation = GenerationRequest(
        prompt="",
        messages=tuple(messages),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=tuple(body.stop_sequences or ()),
        ignore_eos=body.ignore_eos,
        speculative=body.speculative,
        tools=anthropic_tools(body.tools),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
    )
    model = body.model or limits.default_model
    return ParsedRequest(model, generation, body.stream, include_usage=True)
