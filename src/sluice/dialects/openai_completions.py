"""The OpenAI (legacy) Completions API, ``POST /v1/completions``: ``text_completion``
chunks and objects (rendered by :mod:`sluice.dialects.openai`)."""

from __future__ import annotations

from sluice.dialects.openai import OpenAIDialect

__all__ = ["DIALECT"]

DIALECT = OpenAIDialect("text", name="openai_completions", path="/v1/completions", prefix="cmpl-")
