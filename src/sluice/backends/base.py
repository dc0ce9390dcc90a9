"""The backend seam: an async iterator of deltas with an ``abort``.

A :class:`Backend` serves one model name. ``generate(request)`` returns a
:class:`Generation` at once (nothing is computed yet); iterating it yields :class:`Delta`
values as the model produces them. ``abort()`` stops the work and frees what it holds (the
engine frees KV blocks, a proxy closes its upstream connection); it is idempotent and safe
in every state, including before the first delta and after the last. ``usage()`` reports
the token counts of what was generated so far, also after an abort.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from sluice.events import FinishReason, Usage

__all__ = ["Backend", "Delta", "Generation", "GenerationRequest"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What to generate. Backends ignore the fields that mean nothing to them."""

    prompt: str
    max_tokens: int | None = None
    # Demo pacing for the ``words`` backend: seconds between tokens (0 = as fast as possible).
    interval_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Delta:
    """Newly generated text; ``finish_reason`` is set on the last delta when known."""

    text: str
    finish_reason: FinishReason | None = None


class Generation(Protocol):
    """One running generation."""

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    async def abort(self) -> None: ...

    def usage(self) -> Usage: ...


class Backend(Protocol):
    """A source of generations for one model name."""

    @property
    def model(self) -> str: ...

    def generate(self, request: GenerationRequest) -> Generation: ...

    async def aclose(self) -> None: ...
