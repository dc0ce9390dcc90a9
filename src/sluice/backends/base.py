"""The backend seam: an async iterator of deltas with an ``abort``.

A :class:`Backend` serves one model name. ``generate(request)`` returns a
:class:`Generation` at once (nothing is computed yet); iterating it yields :class:`Delta`
values as the model produces them. A delta holds everything produced since the consumer
last asked: usually one token, several when the consumer was busy or the source produces
in bursts (an upstream read, a replayed text), so per-delta costs are paid per burst, not
per token. A generation that never suspends yields the loop now and then itself.
``abort()`` stops the work and frees what it holds (the engine frees KV blocks, a proxy
closes its upstream connection); it is idempotent and safe in every state, including
before the first delta and after the last. ``usage()`` reports the token counts of what
was generated so far, also after an abort.

Tools. A chat request may carry tool definitions (:class:`Tool`), a :class:`ToolChoice`,
a :class:`ResponseFormat` and a history with the assistant's :class:`ToolCall` values and
the ``tool`` messages that answer them. JSON the client wrote is carried as JSON text:
a call's arguments as the text itself, a tool's parameter schema or a response schema as
the compact text of the value it parsed to, so a proxy passes on the same values. A
backend that cannot honour them (``words``) calls :func:`refuse_tools` when it starts,
which raises a :class:`~sluice.errors.BadRequestError` naming the first such field (a
400): a request with tools is refused unless its ``tool_choice`` is ``none`` (then the model must not
call one, which such a backend honours by not seeing them); so are a ``required`` or
named ``tool_choice``, a ``json_object`` or ``json_schema`` response format, and a history
holding tool calls. The engine honours tools when its model's chat template renders them,
and checks the rest itself (:mod:`sluice.backends.engine`).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from sluice.errors import BadRequestError
from sluice.events import FinishReason, TextDelta, ToolCallDelta, Usage

__all__ = [
    "MAX_TOOLS",
    "MAX_TOOL_CALLS",
    "Backend",
    "ChatMessage",
    "Delta",
    "Generation",
    "GenerationRequest",
    "ResponseFormat",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolChoiceMode",
    "model_version",
    "refuse_tools",
]

# OpenAI's own limit on a request's tools; the body limit bounds their total size.
MAX_TOOLS: Final = 128
# Tool calls one assistant message of a history may hold (as many as there are tools).
MAX_TOOL_CALLS: Final = MAX_TOOLS


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the assistant made, in a chat's history; ``arguments`` is its JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a chat: ``role`` is ``system``, ``user``, ``assistant`` or ``tool``.

    An assistant message may hold the ``tool_calls`` it made; a ``tool`` message answers
    the call named by ``tool_call_id``.
    """

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call. ``parameters`` is the JSON text of its JSON Schema
    (``None``: it takes none); ``strict`` is OpenAI's flag, ``None`` when not given."""

    name: str
    description: str | None = None
    parameters: str | None = None
    strict: bool | None = None


class ToolChoiceMode(enum.StrEnum):
    """Whether the model may (``auto``), must not (``none``) or must (``required``) call a
    tool, or must call the one named (``function``)."""

    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    FUNCTION = "function"


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A request's ``tool_choice``; ``name`` is set for :attr:`ToolChoiceMode.FUNCTION`."""

    mode: ToolChoiceMode
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """OpenAI's ``response_format``: ``json_schema`` is the JSON text of its
    ``json_schema`` object (name, schema, strict, ...) for that type, else ``None``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: str | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What to generate. Backends ignore the fields that mean nothing to them.

    A chat request sets ``messages``; a backend then renders them its own way (the engine
    through its chat template, a proxy as an upstream chat request) and ignores ``prompt``.
    """

    prompt: str
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int | None = None
    # Demo pacing for the ``words`` backend: seconds between tokens (0 = as fast as possible).
    interval_s: float = 0.0
    # Sampling, for model backends; ``None`` keeps the backend's default.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Generate all max_tokens even past an end-of-sequence token (benchmarks, tests; vLLM
    # accepts the same extension).
    ignore_eos: bool = False
    # False: the embedded engine never speculates for this request (an opt-out; speculation
    # changes no output, only how fast it comes).
    speculative: bool = True
    # When the HTTP request began to arrive (time.monotonic()), if the server knows: time
    # already spent counts against a time-to-first-token objective.
    received_at: float | None = None
    # Tool calling and constrained output (see the module doc); ``None``: not given.
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Who the stream is for, as a model alias routes it (sluice.rollout.assignment): the
    # request's ``user``, an ``X-Sluice-Routing-Key`` header, else the API key's tenant.
    routing_key: str | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    """Newly generated content, one event per token; ``finish_reason`` is set on the last
    delta when the backend knows why the generation ended, and ``stop_sequence`` with it
    when a stop string ended it (the string that matched)."""

    events: Sequence[TextDelta | ToolCallDelta] = ()
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None


class Generation(Protocol):
    """One running generation.

    ``start()`` admits the work before any output (the engine queues the request, a proxy
    gets the upstream's response headers) and raises :class:`~sluice.errors.CapacityError`,
    :class:`~sluice.errors.BadRequestError` or :class:`~sluice.errors.BackendError` if it
    cannot run, so a refusal can still become an HTTP status. The producer calls it once,
    before iterating; iterating without it starts the work first.
    """

    async def start(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    async def abort(self) -> None: ...

    def usage(self) -> Usage: ...


class Backend(Protocol):
    """A source of generations for one model name."""

    @property
    def model(self) -> str: ...

    def generate(self, request: GenerationRequest) -> Generation: ...

    async def aclose(self) -> None: ...


def model_version(generation: object) -> str | None:
    """The version of a model alias that ``generation`` runs on (a
    :class:`~sluice.rollout.backend.RoutedGeneration` names it), else ``None``."""
    version = getattr(generation, "model_version", None)
    return version if isinstance(version, str) else None


def refuse_tools(request: GenerationRequest) -> None:
    """Raise :class:`~sluice.errors.BadRequestError` naming the first field of ``request``
    that only a backend able to call tools or constrain its output could honour (see the
    module doc); return if there is none. For backends that can do neither."""
    choice = request.tool_choice
    mode = None if choice is None else choice.mode
    why = "this model cannot call tools (a model served through --upstream can)"
    if request.tools and mode is not ToolChoiceMode.NONE:
        raise BadRequestError(f'tools: {why}; without tool_choice "none" they cannot be honoured')
    if mode is ToolChoiceMode.REQUIRED or mode is ToolChoiceMode.FUNCTION:
        raise BadRequestError(f"tool_choice: {why}")
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        raise BadRequestError(
            f"response_format: this model cannot constrain its output to {response_format.type}"
        )
    if any(message.tool_calls for message in request.messages or ()):
        raise BadRequestError(f"messages: the history holds tool calls, and {why}")
