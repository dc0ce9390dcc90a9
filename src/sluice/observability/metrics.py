"""Prometheus metrics, served at ``GET /metrics``.

One registry per app (several apps can live in one process, as in tests). Stream metrics
come from the hub through the :class:`~sluice.streams.hub.StreamObserver` hooks (which also
write the stream log's line when a stream ends, see :mod:`sluice.observability.logs`);
engine gauges are read from each engine backend's ``stats()`` when ``/metrics`` is
scraped; the abort timings from each engine backend's abort observer.

Every stream metric has ``model`` and ``model_version`` labels (the version is the
backend's ``version`` attribute: for the embedded engine, the first 12 hex digits of the
SHA-256 of its weights; empty when a backend has none).

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
``sluice_e2e_seconds``                      stream created -> terminal event
``sluice_streams_active``                   live streams (gauge)
``sluice_streams_finished_total``           by ``reason``: stop, length, tool_calls,
                                            cancelled, client_gone, error
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
                                            and used, prefix-cache hits, preemptions
                                            (gauges, per model)
=========================================== =================================================
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice.errors import CapacityError, TenantLimitError, UnknownModelError
from sluice.observability.logs import log_stream_end
from sluice.streams.hub import Stream

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: from sub-millisecond token gaps to minute-long generations.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_ENGINE_GAUGES = {
    "running": "sequences the engine runs",
    "waiting": "sequences waiting for the engine",
    "kv_blocks": "KV-cache blocks in all",
    "kv_blocks_used": "KV-cache blocks held by sequences",
    "prefix_hits": "prompt blocks served from the prefix cache since start",
    "preemptions": "sequences preempted (recomputed later) since start",
}


class Metrics:
    """The app's metrics; also the hub's stream observer."""

    def __init__(self, versions: Mapping[str, str]) -> None:
        self._versions = dict(versions)
        self.registry = registry = CollectorRegistry(auto_describe=True)
        labels = ("model", "model_version")

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, registry=registry, buckets=_LATENCY_BUCKETS)

        self.sse_gap = histogram(
            "sluice_sse_inter_event_gap_seconds", "Gap between writes of token events"
        )
        # The per-model children, so a write's observation skips the label lookup.
        self._sse_gap_by_model: dict[str, Histogram] = {}
        self.cancel_to_kv_free = Histogram(
            "sluice_cancel_to_kv_free_seconds",
            "Time from an engine request's abort to its KV blocks being free",
            ("model",),
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.ttft = histogram("sluice_time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("sluice_inter_token_latency_seconds", "Gap between token appends")
        self.queue = histogram("sluice_queue_seconds", "Time until the backend admitted it")
        self.e2e = histogram("sluice_e2e_seconds", "Time from creation to the end")
        self.active = Gauge("sluice_streams_active", "Live streams", labels, registry=registry)
        self.finished_total = Counter(
            "sluice_streams_finished", "Ended streams", (*labels, "reason"), registry=registry
        )
        self.tokens_total = Counter(
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
        self.evictions = Counter(
            "sluice_streams_evicted", "Streams evicted", ("reason",), registry=registry
        )
        self.engine = {
            name: Gauge(f"sluice_engine_{name}", doc, ("model",), registry=registry)
            for name, doc in _ENGINE_GAUGES.items()
        }

    def _labels(self, stream: Stream) -> tuple[str, str]:
        return stream.model, self._versions.get(stream.model, "")

    # -- the hub's StreamObserver ---------------------------------------------------------

    def started(self, stream: Stream, queued_s: float) -> None:
        labels = self._labels(stream)
        self.queue.labels(*labels).observe(queued_s)
        self.active.labels(*labels).inc()

    def tokens(self, stream: Stream, count: int, since_s: float, first: bool) -> None:
        labels = self._labels(stream)
        (self.ttft if first else self.itl).labels(*labels).observe(since_s)
        self.tokens_total.labels(*labels).inc(count)

    def finished(self, stream: Stream, outcome: str, e2e_s: float) -> None:
        labels = self._labels(stream)
        if stream.admitted:  # counted active by started()
            self.active.labels(*labels).dec()
        self.finished_total.labels(*labels, outcome).inc()
        self.e2e.labels(*labels).observe(e2e_s)
        log_stream_end(stream, outcome, e2e_s)  # the stream log (``--access-log``)

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

    async def render(self, engines: Mapping[str, Callable[[], Awaitable[dict[str, int]]]]) -> bytes:
        """The text exposition, after reading each engine's gauges."""
        for model, stats in engines.items():
            for name, value in (await stats()).items():
                gauge = self.engine.get(name)
                if gauge is not None:
                    gauge.labels(model).set(value)
        return generate_latest(self.registry)
