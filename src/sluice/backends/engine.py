"""The ``engine`` backend: generations served by the in-process inference engine.

Each :class:`EngineGeneration` encodes its prompt (a chat's messages through the model's
:class:`~sluice.backends.chat.ChatTemplate` first) and adds its request through an
:class:`~sluice.engine.driver.AsyncEngine` in ``start()``, so admission errors surface
before the stream's first event. A :class:`~sluice.backends.prompt.PromptPreparer` makes
the token ids: an oversized prompt is refused before it is encoded, and large prompts are
rendered and encoded on its worker threads, never on the event loop. Errors are translated
at this boundary:

- the scheduler's ``QueueFullError`` becomes :class:`~sluice.errors.CapacityError`
  (``retry_after_s=1``, reason ``queue_full``);
- with a ``ttft_slo_s``, a request whose predicted time to first token (plus the time it
  already spent in the server, from ``GenerationRequest.received_at``, plus
  ``ttft_headroom_s``) is over it is refused with :class:`~sluice.errors.CapacityError`
  (reason ``ttft_slo``) before it is queued:
  :class:`~sluice.backends.admission.TtftPredictor` replays the scheduler over the requests
  in the engine, with step costs fitted to the steps it ran, and
  :class:`~sluice.backends.admission.RetryAfterPacer` sets the refusal's ``Retry-After``;
- ``ValueError`` (an empty or too long prompt, a bad ``max_tokens``) becomes
  :class:`~sluice.errors.BadRequestError`;
- tool fields the engine cannot honour get an :class:`~sluice.errors.InvalidParameterError`
  naming the field, before anything is queued (:mod:`sluice.backends.engine_tools`);
- the driver's errors (a failed step, a stopped driver) become a retryable
  :class:`~sluice.errors.BackendError`; a request the engine failed alone
  (:class:`~sluice.engine.driver.EngineRequestError`) a non-retryable one. Their messages
  are the driver's, written for clients (no exception text of the engine's).

Every engine output becomes one :class:`~sluice.backends.base.Delta`; its text (if any) is
one :class:`~sluice.events.TextDelta`, or, when the model was shown tools, the text and tool
calls read in it (:mod:`sluice.backends.engine_tools` decides which tools it is shown, what
is refused, and how the answer is read). ``abort()`` aborts the engine request and returns
once the engine thread applied the abort (by the end of its current step), when the
request's KV blocks are free; a generation abandoned mid-iteration (its task cancelled)
aborts the same way. The time each abort took goes to the backend's abort observer
(:meth:`EngineBackend.set_abort_observer`; the app's metrics). The backend does not own
the driver: whoever starts it (``async with AsyncEngine(...)``) stops it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol, TypeVar

import torch

from sluice.backends.admission import RetryAfterPacer, StepCostModel, TtftPredictor
from sluice.backends.base import Delta, GenerationRequest
from sluice.backends.chat import SIMPLE_TEMPLATE, ChatTemplate
from sluice.backends.engine_tools import read_tool_calls, tools_to_show
from sluice.backends.prompt import PromptEncoder, PromptPreparer
from sluice.backends.tool_call_parser import HermesToolCallParser
from sluice.engine.driver import EngineDriverError, EngineRequestError, RequestStream
from sluice.engine.engine import Engine, EngineConfig, RequestOutput, StepStats
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import QueueFullError
from sluice.errors import BackendError, BadRequestError, CapacityError
from sluice.events import FinishReason, TextDelta, Usage

__all__ = [
    "Admission",
    "EngineBackend",
    "EngineDriver",
    "EngineGeneration",
    "PromptEncoder",
    "engine_stats",
]

# Seconds a client is asked to wait when the engine's waiting queue is full.
_QUEUE_FULL_RETRY_AFTER_S = 1.0
# Text for the warm-up requests' prompts (any tokens do).
_WARM_UP_TEXT = "Return the number of items in the sequence, or raise an error if it is empty."
# A refusal's Retry-After is the predicted TTFT over the SLO, predicted up to this many SLOs.
_RETRY_HORIZON_SLOS = 10.0

T = TypeVar("T")

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}

# Told the seconds from asking for an abort to the engine having applied it (blocks free).
AbortObserver = Callable[[float], None]


class EngineDriver(Protocol):
    """What the backend drives: :class:`~sluice.engine.driver.AsyncEngine` (the engine on a
    thread of this process) or :class:`~sluice.engine_process.ProcessEngine` (in a child
    process). ``call`` runs a module-level function on the engine between steps."""

    @property
    def config(self) -> EngineConfig: ...

    def set_step_observer(self, observer: Callable[[StepStats], None] | None) -> None: ...

    async def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream: ...

    async def abort(self, request_id: int) -> bool: ...

    async def call(self, fn: Callable[[Engine], T]) -> T: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """What the backend's generations share to decide admission: the predictor of their
    time to first token, the pacer of refusals' Retry-After, and the SLO (None: off) with
    the part of it kept for what the server cannot see: the first token's way out of its
    event loop, over the network, and through the client."""

    predictor: TtftPredictor
    pacer: RetryAfterPacer
    ttft_slo_s: float | None
    ttft_headroom_s: float = 0.0  # of the SLO, kept for the way to the client


class EngineGeneration:
    """One engine request, added when iteration starts; iterable once."""

    __slots__ = (
        "_aborted",
        "_admission",
        "_driver",
        "_finished",
        "_latest",
        "_max_tokens",
        "_num_prompt_tokens",
        "_on_abort_freed",
        "_params",
        "_parser",
        "_prompts",
        "_request",
        "_started",
        "_stream",
        "_tracked",
    )

    def __init__(
        self,
        driver: EngineDriver,
        prompts: PromptPreparer,
        request: GenerationRequest,
        params: SamplingParams,
        max_tokens: int,
        admission: Admission,
        on_abort_freed: AbortObserver | None = None,
    ) -> None:
        self._driver = driver
        self._on_abort_freed = on_abort_freed
        self._admission = admission
        self._tracked = False  # counted among the predictor's requests
        self._prompts = prompts
        self._request = request
        self._params = params
        self._max_tokens = max_tokens
        self._started = False
        self._aborted = False
        self._finished = False
        self._stream: RequestStream | None = None
        self._latest: RequestOutput | None = None
        self._num_prompt_tokens = 0
        self._parser: HermesToolCallParser | None = None  # set when the model sees tools

    @property
    def request_id(self) -> int | None:
        """The engine's id for this request, once it was added."""
        return None if self._stream is None else self._stream.request_id

    async def start(self) -> None:
        """Queue the request in the engine; admission errors are raised here."""
        if self._stream is not None or self._aborted:
            return
        try:
            tools = tools_to_show(self._request, renders_tools=self._prompts.renders_tools)
            params = _request_params(self._params, self._request, self._max_tokens)
            prompt_ids = await self._prompts.prompt_ids(
                self._request, self._max_tokens, tools=tools
            )
        except ValueError as exc:
            raise BadRequestError(str(exc)) from exc
        if self._abort_requested():  # abort() ran while the prompt was being made
            return
        self._num_prompt_tokens = len(prompt_ids)
        self._parser = HermesToolCallParser() if tools else None
        self._admit()  # counts it in the predictor at once, so concurrent starts see it
        try:
            stream = await self._driver.add_request(prompt_ids, params)
        except QueueFullError as exc:
            self._leave()
            now = time.monotonic()
            retry_after_s = self._admission.pacer.retry_after_s(_QUEUE_FULL_RETRY_AFTER_S, now)
            self._admission.pacer.refused(now)
            raise CapacityError(
                f"the engine's waiting queue is full: {exc}",
                retry_after_s=retry_after_s,
                reason="queue_full",
            ) from exc
        except ValueError as exc:
            self._leave()
            raise BadRequestError(str(exc)) from exc
        except EngineDriverError as exc:
            self._leave()
            raise BackendError(str(exc), retryable=True) from exc
        except BaseException:
            self._leave()
            raise
        self._stream = stream
        self._admission.pacer.admitted(time.monotonic())  # in the engine's queue now
        if self._abort_requested():  # abort() ran while the request was being added
            self._finished = True
            self._leave()
            await self._abort_engine(stream.request_id)

    def _admit(self) -> None:
        """Refuse the request if its predicted time to first token is over the SLO; else
        count it among the engine's requests."""
        admission, num_tokens = self._admission, self._num_prompt_tokens
        predictor, max_tokens = admission.predictor, self._max_tokens
        slo_s = admission.ttft_slo_s
        predicted_s = None
        now = time.monotonic()
        if slo_s is not None:
            # Replayed past the SLO, so that Retry-After says when the queue ahead is gone.
            limit_s = _RETRY_HORIZON_SLOS * slo_s
            predicted_s = predictor.predict_s(num_tokens, max_tokens, limit_s=limit_s)
            received_at = self._request.received_at
            spent_s = 0.0 if received_at is None else max(0.0, now - received_at)
            total_s = None if predicted_s is None else spent_s + predicted_s
            if total_s is not None and total_s + admission.ttft_headroom_s > slo_s:
                excess_s = total_s + admission.ttft_headroom_s - slo_s
                retry_after_s = admission.pacer.retry_after_s(excess_s, now)
                admission.pacer.refused(now)
                raise CapacityError(
                    f"predicted time to first token {total_s:.2f} s is over the "
                    f"{slo_s:g} s objective (less {admission.ttft_headroom_s:g} s headroom)",
                    retry_after_s=retry_after_s,
                    reason="ttft_slo",
                )
        predictor.queued(self, num_tokens, max_tokens, now, predicted_s)
        self._tracked = True

    def _leave(self) -> None:
        """Leave the predictor's requests (at the end, however it came)."""
        if self._tracked:
            self._tracked = False
            self._admission.predictor.left(self)

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
                if self._tracked:
                    self._admission.predictor.generated(
                        self, output.num_completion_tokens, output.produced_at, time.monotonic()
                    )
                self._latest = output
                reason = None
                if output.finished:
                    self._finished = True
                    if output.finish_reason is not None:
                        reason = _FINISH_REASONS[output.finish_reason]
                if self._parser is None:
                    events = [TextDelta(output.new_text)] if output.new_text else []
                    yield Delta(events, reason, output.stop_sequence)
                else:
                    yield read_tool_calls(
                        self._parser,
                        output.new_text,
                        reason,
                        finished=output.finished,
                        stop_sequence=output.stop_sequence,
                    )
        except EngineDriverError as exc:
            self._finished = True  # the driver has already dropped the request
            retryable = not isinstance(exc, EngineRequestError)
            raise BackendError(str(exc), retryable=retryable) from exc
        finally:
            self._leave()
            if not self._finished:  # cancelled, aborted or abandoned: free the blocks
                self._finished = True
                await self._abort_engine(stream.request_id)

    def _abort_requested(self) -> bool:
        return self._aborted

    async def abort(self) -> None:
        """Abort the engine request and wait until its KV blocks are free (idempotent;
        safe before the start and after the end)."""
        self._aborted = True
        self._leave()
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
    if not request.speculative:
        changes["speculative"] = False
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


class EngineBackend:
    """Serves one model name from an :class:`EngineDriver`.

    ``params`` holds the sampling settings of every request (greedy, stop tokens, ...); a
    request's ``max_tokens`` (else ``default_max_tokens``) replaces its ``max_tokens``.
    """

    def __init__(
        self,
        model_name: str,
        driver: EngineDriver,
        tokenizer: PromptEncoder,
        *,
        default_max_tokens: int,
        params: SamplingParams | None = None,
        chat_template: ChatTemplate | None = None,
        version: str = "",
        ttft_slo_s: float | None = None,
        ttft_headroom_s: float = 0.0,
    ) -> None:
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be at least 1, got {default_max_tokens}")
        if ttft_slo_s is not None and not ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be positive, got {ttft_slo_s}")
        if not 0 <= ttft_headroom_s < (ttft_slo_s or math.inf):
            raise ValueError(
                f"ttft_headroom_s must be at least 0 and under the SLO, got {ttft_headroom_s}"
            )
        self._model = model_name
        self._driver = driver
        self._tokenizer = tokenizer
        self._default_max_tokens = default_max_tokens
        self._params = params or SamplingParams()
        chat = chat_template or ChatTemplate(SIMPLE_TEMPLATE)
        self._prompts = PromptPreparer(tokenizer, chat, driver.config.max_model_len)
        self.version = version  # the ``model_version`` metrics label
        # Off (None) by default: refusing on a prediction is an operator's choice.
        self.ttft_slo_s = ttft_slo_s
        config = driver.config
        self.step_cost = StepCostModel()
        self.predictor = TtftPredictor(
            config.max_num_seqs, config.max_num_batched_tokens, self.step_cost
        )
        self._admission = Admission(self.predictor, RetryAfterPacer(), ttft_slo_s, ttft_headroom_s)
        driver.set_step_observer(self.step_cost.observe)
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
            self._prompts,
            request,
            self._params,
            max_tokens,
            self._admission,
            self._on_abort_freed,
        )

    async def warm_up(self) -> None:
        """Run throwaway greedy requests on the started driver, so torch's first-call
        costs are paid before the first client comes: a short and a long prompt (16 and
        8 tokens). With a TTFT objective, also a batch that fills the step's token budget
        and decodes side by side, so the step-cost model has seen full steps before it
        predicts for a burst."""
        token_ids = self._tokenizer.encode(_WARM_UP_TEXT)
        config = self._driver.config
        jobs = [(8, 16), (96, 8)]  # (prompt tokens, max_tokens)
        if self.ttft_slo_s is not None:
            num_batch = min(32, config.max_num_seqs)
            prompt_len = max(1, config.max_num_batched_tokens // 8)
            jobs += [(prompt_len, 8)] * num_batch
        streams = []
        for prompt_len, max_tokens in jobs:
            prompt_len = min(prompt_len, config.max_model_len - max_tokens)
            prompt = (token_ids * (1 + prompt_len // len(token_ids)))[:prompt_len]
            params = SamplingParams(max_tokens, temperature=0, ignore_eos=True)
            streams.append(await self._driver.add_request(prompt, params))
        for stream in streams:
            async for _ in stream:
                pass

    async def stats(self) -> dict[str, int]:
        """The engine's queues and KV cache right now (for ``/readyz`` and operators)."""

        stats = await self._driver.call(engine_stats)
        stats["queued_prompt_tokens"] = self.predictor.num_queued_tokens
        step_s = self.step_cost.step_s(0, stats["running"])
        stats["decode_step_ms"] = -1 if step_s is None else round(step_s * 1000)
        stats["ttft_error_ratio_pct"] = round(self.predictor.ratio * 100)
        return stats

    async def aclose(self) -> None:
        """Stop the prompt workers; the driver belongs to whoever started it."""
        self._prompts.close()


def engine_stats(engine: Engine) -> dict[str, int]:
    """The engine's queues and KV cache (run on the engine's thread, or in its process)."""
    blocks = engine.block_manager_stats()
    return {
        "running": engine.num_running,
        "waiting": engine.num_waiting,
        "kv_blocks": blocks.num_blocks,
        "kv_blocks_used": blocks.num_used_blocks,
        "prefix_hits": blocks.num_prefix_hits,
        "preemptions": engine.scheduler.num_preemptions,
        # Read where the steps run (their thread, or the engine's process).
        "threads": engine.threads.threads
        if engine.threads is not None
        else torch.get_num_threads(),
        **_spec_decode_stats(engine),
    }


def _spec_decode_stats(engine: Engine) -> dict[str, int]:
    """Speculative decoding's counters (vLLM's ``spec_decode`` series), when it is on: drafts,
    drafted and accepted tokens, each per draft position (1-based), the acceptance rate in
    percent and the last step's ``k``."""
    spec = engine.spec_stats
    if spec is None:
        return {}
    stats = {
        "spec_decode_drafts": spec.num_drafts,
        "spec_decode_draft_tokens": spec.num_draft_tokens,
        "spec_decode_accepted_tokens": spec.num_accepted_tokens,
        "spec_decode_acceptance_pct": round(spec.acceptance_rate * 100),
        "spec_decode_k": spec.last_k,
    }
    for position, (drafted, accepted) in enumerate(
        zip(spec.num_draft_tokens_per_pos, spec.num_accepted_tokens_per_pos, strict=True), 1
    ):
        stats[f"spec_decode_draft_tokens_pos_{position}"] = drafted
        stats[f"spec_decode_accepted_tokens_pos_{position}"] = accepted
    return stats
