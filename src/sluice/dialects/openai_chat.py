"""The OpenAI Chat Completions API, ``POST /v1/chat/completions``: chunks and whole
``chat.completion`` objects (rendered by :mod:`sluice.dialects.openai`)."""

from __future__ import annotations

from sluice.dialects.openai import OpenAIDialect

__all__ = ["DIALECT"]

DIALECT = OpenAIDialect("chat", name="openai_chat", path="/v1/chat/completions", prefix="chatcmpl-")
