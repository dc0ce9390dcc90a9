"""The dialect seam: what one wire dialect of Sluice's streaming APIs is.

A **dialect** turns the stream's neutral events into its clients' messages and, for the
APIs that create streams (OpenAI Chat Completions, Anthropic Messages, ...), parses their
request bodies and shapes their whole answers and errors. It does no I/O and knows no
transport: a message is an event name (``None`` for SSE's unnamed ``message``) and a data
text (JSON, or a sentinel such as OpenAI's ``[DONE]``). Transports frame messages (SSE
frames, WebSocket text frames, long-poll batches) and give them ids.

Every dialect is one module holding one object that satisfies :class:`Dialect` (or
:class:`ApiDialect`), listed once in :mod:`sluice.dialects.registry`; nothing else names
dialects. How a stream renders is fixed when it is created and kept with it as a
:class:`RenderMeta` of plain values, so a resume, on any replica and any transport,
renders exactly what the first reader got.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel

from sluice.backends.base import GenerationRequest
from sluice.errors import ConfigError
from sluice.events import NeutralEvent, RenderMeta

__all__ = [
    "ApiDialect",
    "Dialect",
    "Message",
    "ParsedRequest",
    "RenderMeta",
    "Renderer",
    "RequestLimits",
    "WholeAnswer",
]

Message = tuple[str | None, str]
"""One message of a dialect: its event name (``None``: unnamed) and its data text."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The bounds a request body is checked against while it is parsed."""

    max_prompt_chars: int = 200_000
    max_tokens_limit: int = 1_000_000
    max_interval_ms: float = 60_000.0
    # Which model a request gets when it names none.
    default_model: str = "words"

    def __post_init__(self) -> None:
        if self.max_prompt_chars < 1 or self.max_tokens_limit < 1:
            raise ConfigError("request limits must be positive")
        if self.max_interval_ms < 0:
            raise ConfigError("max_interval_ms must not be negative")


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A request body, parsed: what to generate and how to answer.

    ``options`` become :attr:`RenderMeta.options` (what the dialect must remember to
    render this stream).
    """

    model: str
    generation: GenerationRequest
    stream: bool
    include_usage: bool = False
    options: tuple[tuple[str, str], ...] = field(default=())


class Renderer(Protocol):
    """One stream's events in one dialect, in order; stateful (an OpenAI stream's first
    chunk carries the role, Anthropic numbers its content blocks), so a reader that
    resumes first renders the events before its position and drops their messages."""

    def render(self, event: NeutralEvent) -> Sequence[Message]:
        """The messages of ``event`` (possibly none); raises ``ProtocolError`` for an
        event after the terminal one."""
        ...


class WholeAnswer(Protocol):
    """A ``"stream": false`` answer, fed every event up to the terminal one."""

    def feed(self, event: NeutralEvent) -> None: ...

    def result(self) -> dict[str, object]:
        """The answer body of a stream that ended well."""
        ...

    def error(self) -> tuple[int, dict[str, object]] | None:
        """The status and body of a stream that ended badly, else ``None``."""
        ...


class Dialect(Protocol):
    """How a stream's events read in one dialect."""

    @property
    def name(self) -> str:
        """The registry name (``native``, ``openai_chat``, ...)."""
        ...

    @property
    def retry_hint(self) -> bool:
        """Whether its SSE responses open with a ``retry:`` hint (EventSource clients
        reconnect by themselves; the SDKs' parsers choke on a ``retry:``-only block)."""
        ...

    def renderer(self, meta: RenderMeta) -> Renderer: ...


class ApiDialect(Dialect, Protocol):
    """A dialect with an endpoint that creates streams: ``POST path``."""

    @property
    def path(self) -> str: ...

    @property
    def response_id_prefix(self) -> str:
        """What a response id starts with (``chatcmpl-``, ``msg_``, ...)."""
        ...

    @property
    def request_model(self) -> type[BaseModel]:
        """The pydantic model that validates its body (what ``GET /openapi.json`` shows)."""
        ...

    def parse(self, payload: object, limits: RequestLimits) -> ParsedRequest:
        """The request of a JSON body; raises ``BadRequestError`` (with ``param`` where
        one field is to blame) for a body it refuses."""
        ...

    def whole(self, meta: RenderMeta) -> WholeAnswer: ...

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> dict[str, object]:
        """The dialect's error object for an answer with ``status``."""
        ...

    def headers(self, meta: RenderMeta) -> Mapping[str, str]:
        """Response headers of its streamed answers, beyond SSE's own."""
        ...
