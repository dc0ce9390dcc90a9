"""A request's prompt token ids, made without blocking the event loop.

Rendering a chat template and encoding text take time in proportion to their size (byte-
level BPE encodes about 0.5 µs a character: a 200,000-character prompt is 90 ms), and
every stream the process serves waits while the loop is held. :class:`PromptPreparer`
makes the ids in three moves:

1. the chat messages, if any, are rendered with the model's template (with the tools the
   backend shows the model, if any);
2. a prompt that cannot fit the context is refused with no encoding at all, from a lower
   bound of its token count (:meth:`PromptEncoder.min_num_tokens`, linear in its length
   and microseconds for the largest prompt accepted);
3. the prompt is encoded.

Work on more than :data:`INLINE_MAX_CHARS` characters (the messages' content for the
render, the prompt for the encode) runs on one of :data:`MAX_PROMPT_WORKERS` worker threads;
smaller work runs inline, where it costs less than the hop to a thread would save. The
encoder must release the GIL (the engine's tokenizer does), or its thread would hold the
loop all the same. The pool is fixed, so a flood of large prompts waits in its queue (one
entry per request being started, which the server's stream limits bound) instead of
spawning threads; a request cancelled while it waits there is dropped from it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from sluice.backends.base import ChatMessage, GenerationRequest, Tool
from sluice.backends.chat import ChatTemplate

__all__ = ["INLINE_MAX_CHARS", "MAX_PROMPT_WORKERS", "PromptEncoder", "PromptPreparer"]

# Up to this many characters, render and encode on the loop: about 0.5 ms at most, while a
# thread hop costs ~0.1 ms; past it a worker thread does the work.
INLINE_MAX_CHARS = 1024
# Worker threads for large prompts: two keep both cores of a small host busy; more would
# take cores from the engine's thread and finish no prompt sooner.
MAX_PROMPT_WORKERS = 2

A = TypeVar("A")
R = TypeVar("R")


class PromptEncoder(Protocol):
    """The part of a tokenizer the backend needs."""

    def encode(self, text: str) -> list[int]: ...

    def min_num_tokens(self, text: str) -> int:
        """A lower bound of ``len(encode(text))`` (0 when none is known), found quickly."""
        ...


class PromptPreparer:
    """Makes the prompt token ids of requests for a model of ``max_model_len`` tokens.

    Raises :class:`ValueError` for a prompt that cannot fit (the caller's 400), and what the
    template raises (:class:`~sluice.errors.BadRequestError`). :meth:`close` stops the
    worker threads."""

    def __init__(
        self,
        encoder: PromptEncoder,
        chat: ChatTemplate,
        max_model_len: int,
        *,
        max_workers: int = MAX_PROMPT_WORKERS,
        inline_max_chars: int = INLINE_MAX_CHARS,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._encoder = encoder
        self._chat = chat
        self._max_model_len = max_model_len
        self._inline_max_chars = inline_max_chars
        # Threads start on the first large prompt, not here.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="sluice-prompt"
        )

    async def prompt_ids(
        self, request: GenerationRequest, max_tokens: int, *, tools: Sequence[Tool] = ()
    ) -> list[int]:
        """The token ids of ``request``'s prompt (its messages rendered with ``tools``, if
        any)."""
        prompt = request.prompt
        if request.messages is not None:
            size = sum(_message_chars(message) for message in request.messages)
            size += sum(len(tool.name) + len(tool.parameters or "") for tool in tools)
            prompt = await self._run(size, self._render, (request.messages, tools))
        min_tokens = self._encoder.min_num_tokens(prompt)
        if min_tokens + max_tokens > self._max_model_len:
            raise ValueError(
                f"prompt of at least {min_tokens} tokens plus max_tokens={max_tokens} "
                f"exceeds max_model_len={self._max_model_len}"
            )
        return await self._run(len(prompt), self._encoder.encode, prompt)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the model tools (see :class:`ChatTemplate`)."""
        return self._chat.renders_tools

    def close(self) -> None:
        """Stop the workers once their current work is done; queued work is dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _render(self, chat: tuple[Sequence[ChatMessage], Sequence[Tool]]) -> str:
        messages, tools = chat
        return self._chat.render(messages, tools) if tools else self._chat.render(messages)

    async def _run(self, size: int, fn: Callable[[A], R], arg: A) -> R:
        """``fn(arg)``: inline for work of up to ``inline_max_chars``, else on a worker."""
        if size <= self._inline_max_chars:
            return fn(arg)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, arg)


def _message_chars(message: ChatMessage) -> int:
    """The characters of a message's content and of the tool calls it holds."""
    calls = sum(len(call.name) + len(call.arguments) for call in message.tool_calls)
    return len(message.content) + calls
