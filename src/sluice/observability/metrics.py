"""Prometheus metrics, served at ``GET /metrics``.

One registry per app (several apps can live in one process, as in tests). Stream metrics
come from the hub through the :class:`~sluice.streams.hub.StreamObserver` hooks (which also
write the stream log's line when a stream ends, see :mod:`sluice.observability.logs`);
each model's state (engine queues, KV cache, cumulative engine counts) is read when
``/metrics`` is scraped (:mod:`sluice.observability.state`); the abort timings come from
each engine backend's abort observer. The ``vllm:`` families a vLLM Grafana dashboard
reads are beside these (:mod:`sluice.observability.vllm`). The families observed per token
are :mod:`sluice.observability.loop_metrics`' lock-free ones. No family has ``_created``
samples; the format follows ``Accept`` (:mod:`sluice.observability.exposition`).

Every stream metric has ``model`` and ``model_version`` labels (the version is the
backend's ``version`` attribute: for the embedded engine, the first 12 hex digits of the
SHA-256 of its weights; empty when a backend has none). A stream of a model alias
(``--models-config``) is labelled with the alias and the version that served it.

A stream the backend refused before admitting it (``start()`` raised: the client got a
``400`` or ``503``) is counted once, as a refusal (``sluice_admission_refusals_total``,
counted by the gateway, and ``sluice_backend_refusals_total`` for capacity): it is not a
finished stream and has no end-to-end time.

=========================================== =================================================
metric                                      what
=========================================== =================================================
``sluice_time_to_first_token_seconds``      stream created -> first token appended (histogram)
``sluice_inter_token_latency_seconds``      between token appends of one stream, per gap,
                                            engine side (histogram; a burst of n tokens
                                            counts as one gap)
``sluice_sse_inter_event_gap_seconds``      between consecutive writes of token events to one
                                            SSE connection, edge side, after the write
                                            (histogram; one observation per write)
``sluice_queue_seconds``                    stream created -> backend admitted it
``sluice_e2e_seconds``                      stream created -> terminal event (admitted or
                                            cancelled streams; not refusals)
``sluice_streams_active``                   live streams (gauge)
``sluice_streams_finished_total``           by ``reason``: stop, length, tool_calls,
                                            cancelled, client_gone, error (not refusals)
``sluice_tokens_total``                     token events appended
``sluice_resumes_total``                    reads that resumed from a Last-Event-ID
``sluice_resume_gaps_total``                resumes refused: the position was dropped
``sluice_admission_refusals_total``         by ``reason``: overloaded, invalid_request,
                                            backend_error, unknown_model, too_many_streams,
                                            tenant_limit, max_connections (``sluice serve
                                            --max-connections``)
``sluice_backend_refusals_total``           works a backend refused in ``start()``, by
                                            ``reason``: queue_full, ttft_slo, capacity
``sluice_streams_limited_total``            streams a hub limit ended, by ``limit``:
                                            max_tokens, max_duration
``sluice_sse_disconnects_total``            SSE connections the server closed, by
                                            ``reason``: send_timeout (the socket did not
                                            drain for ``send_timeout_s``)
``sluice_sse_coalesced_events_total``       token events merged into others for lagging
                                            readers (the merged events are not counted)
``sluice_event_log_bytes``                  memory the event logs hold, live and retained
                                            (gauge; ``--log-memory-budget`` bounds it)
``sluice_streams_evicted_total``            retained streams dropped early to make room, by
                                            ``reason``: log_memory, tenant_log_bytes,
                                            tenant_retained_streams, max_streams
``sluice_cancel_to_kv_free_seconds``        an engine request's abort -> the engine thread
                                            applied it and its KV blocks are free
                                            (histogram, per ``model``)
``sluice_engine_*``                         running and waiting sequences, KV blocks total
                                            and used (gauges); ``_prefix_hits_total`` and
                                            ``_preemptions_total`` since the engine started
                                            (counters); per ``model``
``sluice_rollout_decisions_total``          decisions on model aliases' rollouts, by
                                            ``alias``, ``action`` (hold, step, complete,
                                            roll_back, start, pause) and ``by`` (auto, admin)
``sluice_rollout_weight_percent``           each alias version's share of new streams
                                            (gauge, by ``alias`` and ``model_version``)
``sluice_gc_frozen_objects``                objects the process froze in the garbage
                                            collector's permanent generation once it had
                                            started (gauge; :mod:`sluice.startup`)
``vllm:*``                                  see :mod:`sluice.observability.vllm`
=========================================== =================================================
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from sluice.backends.base import model_version
from sluice.errors import CapacityError, TenantLimitError, UnknownModelError
from sluice.observability.exposition import Registry, encode
from sluice.observability.logs import log_stream_end
from sluice.observability.loop_metrics import (
    LoopCounter,
    LoopCounterChild,
    LoopHistogram,
    LoopHistogramChild,
)
from sluice.observability.state import ModelState, StateCollector
from sluice.observability.vllm import VllmFamilies, VllmSeries
from sluice.streams.hub import Stream

__all__ = ["Metrics"]

# Seconds: from sub-millisecond token gaps to minute-long generations.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


@dataclass(slots=True)
class _Timing:
    """Offsets from a live stream's creation, in seconds, for the phase histograms."""

    admitted_s: float
    first_token_s: float | None = None
    last_token_s: float = 0.0


@dataclass(frozen=True, slots=True)
class _TokenSeries:
    """One model's children of the families observed per token delta (looked up once)."""

    ttft: Histogram
    itl: LoopHistogramChild
    tokens_total: LoopCounterChild
    vllm: VllmSeries


class Metrics:
    """The app's metrics; also the hub's stream observer."""

    def __init__(self, versions: Mapping[str, str]) -> None:
        self._versions = dict(versions)
        self.registry = registry = Registry(auto_describe=True)
        labels = ("model", "model_version")

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, registry=registry, buckets=_LATENCY_BUCKETS)

        def per_token_histogram(name: str, doc: str) -> LoopHistogram:
            return LoopHistogram(name, doc, labels, registry=registry, buckets=_LATENCY_BUCKETS)

        self.sse_gap = per_token_histogram(
            "sluice_sse_inter_event_gap_seconds", "Gap between writes of token events"
        )
        # The per-model children, so a write's observation skips the label lookup.
        self._sse_gap_by_model: dict[str, LoopHistogramChild] = {}
        self.cancel_to_kv_free = Histogram(
            "sluice_cancel_to_kv_free_seconds",
            "Time from an engine request's abort to its KV blocks being free",
            ("model",),
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.ttft = histogram("sluice_time_to_first_token_seconds", "Time to first token")
        self.itl = per_token_histogram(
            "sluice_inter_token_latency_seconds", "Gap between token appends"
        )
        self.queue = histogram("sluice_queue_seconds", "Time until the backend admitted it")
        self.e2e = histogram("sluice_e2e_seconds", "Time from creation to the end")
        self.active = Gauge("sluice_streams_active", "Live streams", labels, registry=registry)
        self.finished_total = Counter(
            "sluice_streams_finished", "Ended streams", (*labels, "reason"), registry=registry
        )
        self.tokens_total = LoopCounter(
            "sluice_tokens", "Token events appended", labels, registry=registry
        )
        self.resumes = Counter("sluice_resumes", "Resumed reads", registry=registry)
        self.resume_gaps = Counter("sluice_resume_gaps", "Refused resumes", registry=registry)
        self.refusals = Counter(
            "sluice_admission_refusals", "Refused streams", ("reason",), registry=registry
        )
        self.backend_refusals = Counter(
            "sluice_backend_refusals",
            "Works refused by a backend when they started",
            (*labels, "reason"),
            registry=registry,
        )
        self.limited_total = Counter(
            "sluice_streams_limited",
            "Streams ended by a limit of the hub",
            (*labels, "limit"),
            registry=registry,
        )
        self.disconnects = Counter(
            "sluice_sse_disconnects",
            "SSE connections closed by the server",
            ("reason",),
            registry=registry,
        )
        self.coalesced = Counter(
            "sluice_sse_coalesced_events",
            "Token events merged for lagging readers",
            registry=registry,
        )
        self.log_bytes = Gauge("sluice_event_log_bytes", "Event log memory", registry=registry)
        # Frozen by a serving process once it has started (sluice.startup): a full
        # collection does not walk them. 0 in a process that serves an app of its own.
        Gauge(
            "sluice_gc_frozen_objects",
            "Objects in the garbage collector's permanent generation",
            registry=registry,
        ).set_function(gc.get_freeze_count)
        self.evictions = Counter(
            "sluice_streams_evicted", "Streams evicted", ("reason",), registry=registry
        )
        self.rollout_decisions = Counter(
            "sluice_rollout_decisions",
            "Decisions on model aliases' rollouts",
            ("alias", "action", "by"),
            registry=registry,
        )
        self.rollout_weight = Gauge(
            "sluice_rollout_weight_percent",
            "Share of an alias's new streams per version",
            ("alias", "model_version"),
            registry=registry,
        )
        self._state = StateCollector(self._versions)
        registry.register(self._state)
        self.vllm = VllmFamilies(registry, self._versions)
        # The per-token children of each model (at most the served models).
        self._token_series: dict[str, _TokenSeries] = {}
        # Live admitted streams' phase offsets, by stream id (at most the hub's streams).
        self._timings: dict[str, _Timing] = {}

    def _labels(self, stream: Stream) -> tuple[str, str]:
        routed = model_version(stream.generation)  # a model alias's version
        return stream.model, routed or self._versions.get(stream.model, "")

    def rollout_decided(
        self, alias: str, action: str, by: str, weights: Mapping[str, float]
    ) -> None:
        """Count a rollout decision and set the alias's weights after it."""
        self.rollout_decisions.labels(alias, action, by).inc()
        for version, weight in weights.items():
            self.rollout_weight.labels(alias, version).set(weight)

    # -- the hub's StreamObserver ---------------------------------------------------------

    def started(self, stream: Stream, queued_s: float) -> None:
        labels = self._labels(stream)
        self.queue.labels(*labels).observe(queued_s)
        self.active.labels(*labels).inc()
        self.vllm.series(stream.model).queue.observe(queued_s)
        self._timings[stream.id] = _Timing(admitted_s=queued_s)

    def tokens(self, stream: Stream, count: int, since_s: float, first: bool) -> None:
        # Once per delta of every stream: the model's children are looked up once.
        series = self._token_series.get(stream.model)
        if series is None:
            series = self._token_series[stream.model] = self._new_token_series(stream)
        vllm = series.vllm
        if first:
            series.ttft.observe(since_s)
            vllm.ttft.observe(since_s)
        else:
            series.itl.observe(since_s)
            vllm.itl.observe(since_s)
            vllm.time_per_output_token.observe(since_s)
        series.tokens_total.inc(count)
        vllm.generation_tokens.inc(count)
        timing = self._timings.get(stream.id)
        if timing is not None:
            # ``since_s`` runs from the previous tokens (the first: from the creation).
            timing.last_token_s = since_s if first else timing.last_token_s + since_s
            if first:
                timing.first_token_s = since_s

    def _new_token_series(self, stream: Stream) -> _TokenSeries:
        labels = self._labels(stream)
        return _TokenSeries(
            ttft=self.ttft.labels(*labels),
            itl=self.itl.labels(*labels),
            tokens_total=self.tokens_total.labels(*labels),
            vllm=self.vllm.series(stream.model),
        )

    def finished(self, stream: Stream, outcome: str, e2e_s: float) -> None:
        timing = self._timings.pop(stream.id, None)
        log_stream_end(stream, outcome, e2e_s)  # the stream log (``--access-log``)
        if not stream.admitted and outcome == "error":
            return  # refused by the backend: counted as a refusal, not as a stream
        labels = self._labels(stream)
        if stream.admitted:  # counted active by started()
            self.active.labels(*labels).dec()
        self.finished_total.labels(*labels, outcome).inc()
        self.e2e.labels(*labels).observe(e2e_s)
        vllm = self.vllm.series(stream.model)
        self.vllm.success(stream.model, outcome).inc()
        vllm.e2e.observe(e2e_s)
        if timing is not None and timing.first_token_s is not None:
            vllm.prefill.observe(max(0.0, timing.first_token_s - timing.admitted_s))
            vllm.decode.observe(timing.last_token_s - timing.first_token_s)
            vllm.inference.observe(max(0.0, timing.last_token_s - timing.admitted_s))
        usage = stream.usage
        num_generated = stream.num_tokens
        if usage is not None:
            vllm.prompt_tokens.inc(usage.prompt_tokens)
            vllm.prefix_cache_queries.inc(usage.prompt_tokens)
            vllm.prefix_cache_hits.inc(usage.cached_tokens)
            vllm.request_prompt_tokens.observe(usage.prompt_tokens)
            # Counted live per token event; a backend's token count can be higher (a token
            # that ends inside a UTF-8 character releases no text, hence no event).
            if usage.completion_tokens > num_generated:
                vllm.generation_tokens.inc(usage.completion_tokens - num_generated)
            num_generated = max(num_generated, usage.completion_tokens)
        vllm.request_generation_tokens.observe(num_generated)
        vllm.request_max_num_generation_tokens.observe(num_generated)

    def limited(self, stream: Stream, limit: str) -> None:
        self.limited_total.labels(*self._labels(stream), limit).inc()

    def refused(self, stream: Stream, reason: str) -> None:
        self.backend_refusals.labels(*self._labels(stream), reason).inc()

    def evicted(self, stream: Stream, reason: str) -> None:
        self.evictions.labels(reason).inc()

    # -- the SSE transports' DeliveryObserver ---------------------------------------------

    def send_timed_out(self) -> None:
        self.disconnects.labels("send_timeout").inc()

    def coalesced_events(self, count: int) -> None:
        self.coalesced.inc(count)

    def token_write_gap(self, model: str, gap_s: float) -> None:
        child = self._sse_gap_by_model.get(model)
        if child is None:
            child = self.sse_gap.labels(model, self._versions.get(model, ""))
            self._sse_gap_by_model[model] = child
        child.observe(gap_s)

    # -- the engine backends' abort observer ----------------------------------------------

    def abort_freed(self, model: str, seconds: float) -> None:
        """An engine request of ``model`` was aborted and its KV blocks freed ``seconds``
        after the abort was asked for."""
        self.cancel_to_kv_free.labels(model).observe(seconds)

    # -- the rest -------------------------------------------------------------------------

    def refused_before_start(self, exc: Exception) -> None:
        """Count a create refused before its stream existed (only capacity and models)."""
        if isinstance(exc, TenantLimitError):
            self.refusals.labels("tenant_limit").inc()
        elif isinstance(exc, CapacityError):
            self.refusals.labels("too_many_streams").inc()
        elif isinstance(exc, UnknownModelError):
            self.refusals.labels("unknown_model").inc()

    async def render(
        self,
        engines: Mapping[str, Callable[[], Awaitable[dict[str, int]]]],
        live: Iterable[Stream] = (),
        accept: str = "",
    ) -> tuple[bytes, str]:
        """The exposition for a scrape whose ``Accept`` header is ``accept``, and its
        content type, after reading each engine's stats (``engines``) and counting the live
        streams (``live``) of the models without one."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for stream in live:
            counts = running if stream.admitted else waiting
            counts[stream.model] = counts.get(stream.model, 0) + 1
        states = {}
        for model in self._versions:
            stats = engines.get(model)
            if stats is not None:
                states[model] = ModelState(engine=await stats())
            else:
                states[model] = ModelState(
                    num_streams_running=running.get(model, 0),
                    num_streams_waiting=waiting.get(model, 0),
                )
        self._state.update(states)
        # Writing several hundred samples takes tens of milliseconds of Python: off the
        # loop, so a scrape does not stall every stream's tokens for that long.
        # prometheus-client collects from any thread (its own HTTP server does).
        return await asyncio.to_thread(encode, self.registry, accept)
