"""The ``engine`` backend: generations served by the in-process inference engine.

Each :class:`EngineGeneration` encodes its prompt (a chat's messages through the model's
:class:`~sluice.backends.chat.ChatTemplate` first) and adds its request through an
:class:`~sluice.engine.driver.AsyncEngine` in ``start()``, so admission errors surface
before the stream's first event, translated at this boundary:

- the scheduler's ``QueueFullError`` becomes :class:`~sluice.errors.CapacityError`
  (``retry_after_s=1``);
- ``ValueError`` (an empty or too long prompt, a bad ``max_tokens``) becomes
  :class:`~sluice.errors.BadRequestError`;
- the driver's errors (a failed step, a stopped driver) become a retryable
  :class:`~sluice.errors.BackendError`.

Every engine output becomes one :class:`~sluice.backends.base.Delta`; its text (if any) is
one :class:`~sluice.events.TextDelta`. ``abort()`` aborts the engine request, whose KV
blocks are then free by the end of the engine's current step. The backend does not own the
driver: whoever starts it (``async with AsyncEngine(...)``) stops it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol

from sluice.backends.base import Delta, GenerationRequest
from sluice.backends.chat import SIMPLE_TEMPLATE, ChatTemplate
from sluice.engine.driver import AsyncEngine, EngineDriverError, RequestStream
from sluice.engine.engine import Engine, RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import QueueFullError
from sluice.errors import BackendError, BadRequestError, CapacityError
from sluice.events import FinishReason, TextDelta, Usage

__all__ = ["EngineBackend", "EngineGeneration", "PromptEncoder"]

# Seconds a client is asked to wait when the engine's waiting queue is full.
_QUEUE_FULL_RETRY_AFTER_S = 1.0

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class PromptEncoder(Protocol):
    """The part of a tokenizer the backend needs."""

    def encode(self, text: str) -> list[int]: ...


class EngineGeneration:
    """One engine request, added when iteration starts; iterable once."""

    __slots__ = (
        "_aborted",
        "_chat",
        "_driver",
        "_encoder",
        "_finished",
        "_latest",
        "_max_tokens",
        "_num_prompt_tokens",
        "_params",
        "_request",
        "_started",
        "_stream",
    )

    def __init__(
        self,
        driver: AsyncEngine,
        encoder: PromptEncoder,
        chat: ChatTemplate,
        request: GenerationRequest,
        params: SamplingParams,
        max_tokens: int,
    ) -> None:
        self._driver = driver
        self._encoder = encoder
        self._chat = chat
        self._request = request
        self._params = params
        self._max_tokens = max_tokens
        self._started = False
        self._aborted = False
        self._finished = False
        self._stream: RequestStream | None = None
        self._latest: RequestOutput | None = None
        self._num_prompt_tokens = 0

    @property
    def request_id(self) -> int | None:
        """The engine's id for this request, once it was added."""
        return None if self._stream is None else self._stream.request_id

    async def start(self) -> None:
        """Queue the request in the engine; admission errors are raised here."""
        if self._stream is not None or self._aborted:
            return
        try:
            prompt = self._request.prompt
            if self._request.messages is not None:
                prompt = self._chat.render(self._request.messages)
            prompt_ids = self._encoder.encode(prompt)
            self._num_prompt_tokens = len(prompt_ids)
            params = _request_params(self._params, self._request, self._max_tokens)
            stream = await self._driver.add_request(prompt_ids, params)
        except QueueFullError as exc:
            raise CapacityError(
                f"the engine's waiting queue is full: {exc}",
                retry_after_s=_QUEUE_FULL_RETRY_AFTER_S,
            ) from exc
        except ValueError as exc:
            raise BadRequestError(str(exc)) from exc
        except EngineDriverError as exc:
            raise BackendError(str(exc), retryable=True) from exc
        self._stream = stream
        if self._abort_requested():  # abort() ran while the request was being added
            self._finished = True
            self._driver.abort_nowait(stream.request_id)

    def __aiter__(self) -> AsyncIterator[Delta]:
        if self._started:
            raise RuntimeError("an EngineGeneration can be iterated only once")
        self._started = True
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        await self.start()
        stream = self._stream
        if stream is None or self._finished:  # aborted before or while starting
            return
        try:
            async for output in stream:
                self._latest = output
                reason = None
                if output.finished:
                    self._finished = True
                    if output.finish_reason is not None:
                        reason = _FINISH_REASONS[output.finish_reason]
                events = [TextDelta(output.new_text)] if output.new_text else []
                yield Delta(events, reason)
        except EngineDriverError as exc:
            self._finished = True  # the driver has already dropped the request
            raise BackendError(str(exc), retryable=True) from exc
        finally:
            if not self._finished:  # cancelled, aborted or abandoned: free the blocks
                self._finished = True
                self._driver.abort_nowait(stream.request_id)

    def _abort_requested(self) -> bool:
        return self._aborted

    async def abort(self) -> None:
        """Abort the engine request (idempotent; safe before the start and after the end)."""
        self._aborted = True
        if self._stream is not None and not self._finished:
            self._finished = True
            self._driver.abort_nowait(self._stream.request_id)

    def usage(self) -> Usage:
        latest = self._latest
        if latest is None:
            return Usage(prompt_tokens=self._num_prompt_tokens, completion_tokens=0)
        return Usage(
            prompt_tokens=latest.num_prompt_tokens,
            completion_tokens=latest.num_completion_tokens,
            cached_tokens=latest.num_cached_tokens,
        )


def _request_params(
    base: SamplingParams, request: GenerationRequest, max_tokens: int
) -> SamplingParams:
    """The backend's sampling settings with what the request sets on top (validated)."""
    changes: dict[str, object] = {"max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(request, name)
        if value is not None:
            changes[name] = value
    if request.stop:
        changes["stop"] = request.stop
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


class EngineBackend:
    """Serves one model name from an :class:`~sluice.engine.driver.AsyncEngine`.

    ``params`` holds the sampling settings of every request (greedy, stop tokens, ...); a
    request's ``max_tokens`` (else ``default_max_tokens``) replaces its ``max_tokens``.
    """

    def __init__(
        self,
        model_name: str,
        driver: AsyncEngine,
        tokenizer: PromptEncoder,
        *,
        default_max_tokens: int,
        params: SamplingParams | None = None,
        chat_template: ChatTemplate | None = None,
        version: str = "",
    ) -> None:
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be at least 1, got {default_max_tokens}")
        self._model = model_name
        self._driver = driver
        self._tokenizer = tokenizer
        self._default_max_tokens = default_max_tokens
        self._params = params or SamplingParams()
        self._chat = chat_template or ChatTemplate(SIMPLE_TEMPLATE)
        self.version = version  # the ``model_version`` metrics label

    @property
    def model(self) -> str:
        return self._model

    def generate(self, request: GenerationRequest) -> EngineGeneration:
        max_tokens = self._default_max_tokens if request.max_tokens is None else request.max_tokens
        return EngineGeneration(
            self._driver, self._tokenizer, self._chat, request, self._params, max_tokens
        )

    async def stats(self) -> dict[str, int]:
        """The engine's queues and KV cache right now (for ``/readyz`` and operators)."""

        def snapshot(engine: Engine) -> dict[str, int]:
            blocks = engine.block_manager_stats()
            return {
                "running": engine.num_running,
                "waiting": engine.num_waiting,
                "kv_blocks": blocks.num_blocks,
                "kv_blocks_used": blocks.num_used_blocks,
                "prefix_hits": blocks.num_prefix_hits,
            }

        return await self._driver.call(snapshot)

    async def aclose(self) -> None:
        """Nothing to release: the driver belongs to whoever started it."""
        return None
