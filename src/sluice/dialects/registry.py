"""Every dialect Sluice speaks, by name; the one place that lists them.

Adding a dialect is one module (see :mod:`sluice.dialects.base`) and one line here: an
:class:`~sluice.dialects.base.ApiDialect` in ``API_DIALECTS`` gets its ``POST`` endpoint
from the gateway's generic handler, and every dialect can render a stream on every
transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from sluice.dialects import (
    anthropic,
    native,
    openai_chat,
    openai_completions,
    openai_responses,
    vercel_ui,
)
from sluice.dialects.base import ApiDialect, Dialect

__all__ = ["API_DIALECTS", "DIALECTS", "NATIVE", "api_dialect", "dialect"]

NATIVE: Final[Dialect] = native.DIALECT

API_DIALECTS: Final[tuple[ApiDialect, ...]] = (
    openai_chat.DIALECT,
    openai_completions.DIALECT,
    anthropic.DIALECT,
    openai_responses.DIALECT,
    vercel_ui.DIALECT,
)
"""The dialects with an endpoint that creates streams, in the order OpenAPI lists them."""

DIALECTS: Final[Mapping[str, Dialect]] = {d.name: d for d in (NATIVE, *API_DIALECTS)}
_API_DIALECTS_BY_NAME: Final[Mapping[str, ApiDialect]] = {d.name: d for d in API_DIALECTS}


def dialect(name: str) -> Dialect:
    """The dialect registered as ``name``; ``KeyError`` for one that is not."""
    return DIALECTS[name]


def api_dialect(name: str) -> ApiDialect:
    """The API dialect registered as ``name`` (its error shape, its endpoint); ``KeyError``
    for one that is not."""
    return _API_DIALECTS_BY_NAME[name]
