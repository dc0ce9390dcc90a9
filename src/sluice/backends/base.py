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
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from sluice.events import FinishReason, TextDelta, ToolCallDelta, Usage

__all__ = ["Backend", "ChatMessage", "Delta", "Generation", "GenerationRequest"]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a chat: ``role`` is ``system``, ``user``, ``assistant`` or ``tool``."""

    role: str
    content: str


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
    # When the HTTP request began to arrive (time.monotonic()), if the server knows: time
    # already spent counts against a time-to-first-token objective.
    received_at: float | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    """Newly generated content, one event per token; ``finish_reason`` is set on the last
    delta when the backend knows why the generation ended."""

    events: Sequence[TextDelta | ToolCallDelta] = ()
    finish_reason: FinishReason | None = None


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
