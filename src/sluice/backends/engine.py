"""The ``engine`` backend: generations served by the in-process inference engine.

Each :class:`EngineGeneration` encodes its prompt (a chat's messages through the model's
:class:`~sluice.backends.chat.ChatTemplate` first) and adds its request through an
:class:`~sluice.engine.driver.AsyncEngine` in ``start()``, so admission errors surface
before the stream's first event, translated at this boundary:

- the scheduler's ``QueueFullError`` becomes :class:`~sluice.errors.CapacityError`
  (``retry_after_s=1``, reason ``queue_full``);
- with a ``ttft_slo_s``, a request whose predicted time to first token is over it is
  refused with :class:`~sluice.errors.CapacityError` (reason ``ttft_slo``) before it is
  queued: the prediction is the prompt tokens queued ahead of it plus its own, divided by
  the prefill rate a :class:`PrefillMeter` measures from the engine's outputs;
- ``ValueError`` (an empty or too long prompt, a bad ``max_tokens``) becomes
  :class:`~sluice.errors.BadRequestError`;
- the driver's errors (a failed step, a stopped driver) become a retryable
  :class:`~sluice.errors.BackendError`.

Every engine output becomes one :class:`~sluice.backends.base.Delta`; its text (if any) is
one :class:`~sluice.events.TextDelta`. ``abort()`` aborts the engine request and returns
once the engine thread applied the abort (by the end of its current step), when the
request's KV blocks are free; a generation abandoned mid-iteration (its task cancelled)
aborts the same way. The time each abort took goes to the backend's abort observer
(:meth:`EngineBackend.set_abort_observer`; the app's metrics). The backend does not own
the driver: whoever starts it (``async with AsyncEngine(...)``) stops it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from sluice.backends.base import Delta, GenerationRequest
from sluice.backends.chat import SIMPLE_TEMPLATE, ChatTemplate
from sluice.engine.driver import AsyncEngine, EngineDriverError, RequestStream
from sluice.engine.engine import Engine, RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import QueueFullError
from sluice.errors import BackendError, BadRequestError, CapacityError
from sluice.events import FinishReason, TextDelta, Usage

__all__ = ["EngineBackend", "EngineGeneration", "PrefillMeter", "PromptEncoder"]

# Seconds a client is asked to wait when the engine's waiting queue is full.
_QUEUE_FULL_RETRY_AFTER_S = 1.0

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}

# Told the seconds from asking for an abort to the engine having applied it (blocks free).
AbortObserver = Callable[[float], None]


class PrefillMeter:
    """Prompt tokens waiting for their first output, and the rate the engine clears them.

    A request's prompt is *queued* from just before it is added to the engine until its
    first output (its prefill is done) or until it leaves without one. While anything is
    queued, the meter is busy: the prompt tokens cleared over each window of at least
    ``min_window_s`` busy seconds are one sample of the rate, and the rate is an EWMA of
    the samples (weight ``alpha``). The rate is measured under the load it predicts for:
    decode steps sharing the token budget, batches full of running sequences and preemption
    all slow it down, as they slow down the time to first token.

    At low load a window holds one small request, so its sample understates what the engine
    can clear in a batch; :meth:`predicted_ttft_s` is therefore never over the SLO for a
    request that would be the only one queued (refusing it would help nobody).
    Time is passed in (seconds on any monotonic clock), so the meter is pure and testable.
    """

    __slots__ = (
        "_alpha",
        "_min_window_s",
        "_window_start",
        "_window_tokens",
        "num_queued_tokens",
        "tokens_per_s",
    )

    def __init__(self, *, alpha: float = 0.25, min_window_s: float = 0.1) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if min_window_s <= 0:
            raise ValueError(f"min_window_s must be positive, got {min_window_s}")
        self._alpha = alpha
        self._min_window_s = min_window_s
        self.num_queued_tokens = 0
        self.tokens_per_s: float | None = None  # None until the first sample
        self._window_start = 0.0
        self._window_tokens = 0

    def predicted_ttft_s(self, num_tokens: int) -> float:
        """Seconds until a prompt of ``num_tokens`` queued now would be prefilled (0 while
        nothing is queued or no rate is known yet)."""
        rate = self.tokens_per_s
        if rate is None or not self.num_queued_tokens:
            return 0.0
        return (self.num_queued_tokens + num_tokens) / rate

    def queued(self, num_tokens: int, now: float) -> None:
        if not self.num_queued_tokens:
            self._window_start = now
            self._window_tokens = 0
        self.num_queued_tokens += num_tokens

    def prefilled(self, num_tokens: int, now: float) -> None:
        """A queued prompt got its first output."""
        self.num_queued_tokens -= num_tokens
        self._window_tokens += num_tokens
        self._sample(now)

    def dropped(self, num_tokens: int, now: float) -> None:
        """A queued prompt left without output (aborted, refused, failed)."""
        self.num_queued_tokens -= num_tokens
        self._sample(now)

    def _sample(self, now: float) -> None:
        elapsed = now - self._window_start
        idle = not self.num_queued_tokens
        if elapsed >= self._min_window_s or (idle and elapsed > 0):
            if self._window_tokens:
                sample = self._window_tokens / elapsed
                rate = self.tokens_per_s
                self.tokens_per_s = sample if rate is None else rate + self._alpha * (sample - rate)
            self._window_start = now
            self._window_tokens = 0


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
        "_meter",
        "_num_prompt_tokens",
        "_on_abort_freed",
        "_params",
        "_queued",
        "_request",
        "_started",
        "_stream",
        "_ttft_slo_s",
    )

    def __init__(
        self,
        driver: AsyncEngine,
        encoder: PromptEncoder,
        chat: ChatTemplate,
        request: GenerationRequest,
        params: SamplingParams,
        max_tokens: int,
        meter: PrefillMeter | None = None,
        ttft_slo_s: float | None = None,
        on_abort_freed: AbortObserver | None = None,
    ) -> None:
        self._driver = driver
        self._on_abort_freed = on_abort_freed
        self._meter = meter or PrefillMeter()
        self._ttft_slo_s = ttft_slo_s
        self._queued = False  # counted in the meter's queued prompt tokens
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
        except ValueError as exc:
            raise BadRequestError(str(exc)) from exc
        self._admit()  # reserves its prompt in the meter, so concurrent starts see it
        try:
            stream = await self._driver.add_request(prompt_ids, params)
        except QueueFullError as exc:
            self._leave_queue(prefilled=False)
            raise CapacityError(
                f"the engine's waiting queue is full: {exc}",
                retry_after_s=_QUEUE_FULL_RETRY_AFTER_S,
                reason="queue_full",
            ) from exc
        except ValueError as exc:
            self._leave_queue(prefilled=False)
            raise BadRequestError(str(exc)) from exc
        except EngineDriverError as exc:
            self._leave_queue(prefilled=False)
            raise BackendError(str(exc), retryable=True) from exc
        except BaseException:
            self._leave_queue(prefilled=False)
            raise
        self._stream = stream
        if self._abort_requested():  # abort() ran while the request was being added
            self._finished = True
            self._leave_queue(prefilled=False)
            await self._abort_engine(stream.request_id)

    def _admit(self) -> None:
        """Refuse the request if its predicted time to first token is over the SLO; else
        count its prompt as queued."""
        meter, num_tokens = self._meter, self._num_prompt_tokens
        slo_s = self._ttft_slo_s
        if slo_s is not None:
            predicted_s = meter.predicted_ttft_s(num_tokens)
            if predicted_s > slo_s:
                raise CapacityError(
                    f"predicted time to first token {predicted_s:.2f} s is over the "
                    f"{slo_s:g} s objective ({meter.num_queued_tokens} prompt tokens queued)",
                    retry_after_s=max(1.0, predicted_s - slo_s),
                    reason="ttft_slo",
                )
        meter.queued(num_tokens, time.monotonic())
        self._queued = True

    def _leave_queue(self, *, prefilled: bool) -> None:
        if self._queued:
            self._queued = False
            if prefilled:
                self._meter.prefilled(self._num_prompt_tokens, time.monotonic())
            else:
                self._meter.dropped(self._num_prompt_tokens, time.monotonic())

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
                if self._queued:
                    self._leave_queue(prefilled=True)
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
            self._leave_queue(prefilled=False)
            if not self._finished:  # cancelled, aborted or abandoned: free the blocks
                self._finished = True
                await self._abort_engine(stream.request_id)

    def _abort_requested(self) -> bool:
        return self._aborted

    async def abort(self) -> None:
        """Abort the engine request and wait until its KV blocks are free (idempotent;
        safe before the start and after the end)."""
        self._aborted = True
        self._leave_queue(prefilled=False)
        if self._stream is not None and not self._finished:
            self._finished = True
            await self._abort_engine(self._stream.request_id)

    async def _abort_engine(self, request_id: int) -> None:
        """Abort between engine steps and report how long that took. The abort is queued
        before the first suspension, so a cancel that interrupts the wait frees the blocks
        all the same (only the observation is lost)."""
        asked = time.monotonic()
        applied = await self._driver.abort(request_id)
        if applied and self._on_abort_freed is not None:
            self._on_abort_freed(time.monotonic() - asked)

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
    if request.ignore_eos:
        changes["ignore_eos"] = True
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
        ttft_slo_s: float | None = None,
    ) -> None:
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be at least 1, got {default_max_tokens}")
        if ttft_slo_s is not None and not ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be positive, got {ttft_slo_s}")
        self._model = model_name
        self._driver = driver
        self._tokenizer = tokenizer
        self._default_max_tokens = default_max_tokens
        self._params = params or SamplingParams()
        self._chat = chat_template or ChatTemplate(SIMPLE_TEMPLATE)
        self.version = version  # the ``model_version`` metrics label
        # Off (None) by default: refusing on a prediction is an operator's choice.
        self.ttft_slo_s = ttft_slo_s
        self.meter = PrefillMeter()
        self._on_abort_freed: AbortObserver | None = None

    def set_abort_observer(self, observer: AbortObserver | None) -> None:
        """Tell ``observer`` the seconds each aborted request took to free its KV blocks
        (from now on; the app points it at its metrics)."""
        self._on_abort_freed = observer

    @property
    def model(self) -> str:
        return self._model

    def generate(self, request: GenerationRequest) -> EngineGeneration:
        max_tokens = self._default_max_tokens if request.max_tokens is None else request.max_tokens
        return EngineGeneration(
            self._driver,
            self._tokenizer,
            self._chat,
            request,
            self._params,
            max_tokens,
            self.meter,
            self.ttft_slo_s,
            self._on_abort_freed,
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
                "preemptions": engine.scheduler.num_preemptions,
            }

        stats = await self._driver.call(snapshot)
        stats["queued_prompt_tokens"] = self.meter.num_queued_tokens
        stats["prefill_tokens_per_s"] = round(self.meter.tokens_per_s or 0)
        return stats

    async def aclose(self) -> None:
        """Nothing to release: the driver belongs to whoever started it."""
        return None
