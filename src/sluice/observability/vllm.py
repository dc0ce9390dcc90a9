"""The ``vllm:`` series a vLLM Grafana dashboard reads, observed from Sluice's streams.

vLLM's dashboards (``examples/online_serving/prometheus_grafana/grafana.json`` in
vllm-project/vllm) fill a ``$model_name`` variable from ``label_values(model_name)`` and
filter every panel on ``{model_name="$model_name"}``. These families carry that label (the
served model name, as in ``GET /v1/models``) and ``model_version`` (as every ``sluice_*``
latency family), with vLLM's names, types and bucket boundaries, so such a dashboard works
against Sluice unchanged. They sit beside the ``sluice_*`` families, which stay as they are.

What each measures here, where Sluice's model of a request differs from vLLM's:

- a request is a stream; one the backend refused before admitting it (a ``400`` or ``503``
  answer) is a refusal, not a request: it is in none of these families;
- queue time: creation to the backend admitting it; prefill: admitted to first token;
  decode: first to last token; inference: admitted to last token (prefill + decode);
- token counts come from the stream's ``Usage`` event, the numbers its client is given
  (a generation that failed with a backend error has none: only the tokens it streamed
  count); generation tokens are also counted live, as they stream, and topped up to the
  usage at the end;
- prefix-cache queries and hits are prompt tokens and the prompt tokens the backend served
  from its cache (``Usage.cached_tokens``), counted when the stream ends;
- ``finished_reason``: ``stop`` (also for ``tool_calls``), ``length``, ``abort``
  (cancelled, or the client went away), ``error``.

The engine's queues, KV-cache fraction and preemptions are read when ``/metrics`` is
scraped (:mod:`sluice.observability.state`).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from sluice.observability.loop_metrics import (
    LoopCounter,
    LoopCounterChild,
    LoopHistogram,
    LoopHistogramChild,
)

__all__ = ["FINISHED_REASONS", "LABELS", "VllmFamilies", "VllmSeries", "finished_reason"]

LABELS = ("model_name", "model_version")

# vLLM's boundaries for time to first token.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# vLLM's boundaries for inter-token latency start at 10 ms; a small model on a CPU and the
# ``words`` demo's bursts release tokens faster than that, so three finer ones come first.
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's boundaries for whole-request times (e2e, queue, prefill, decode, inference).
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# vLLM builds token-count buckets 1, 2, 5, 10, ... up to the model's context length; the
# observer does not know that length, so they go up to the hub's default cap on the tokens
# of one stream (longer counts land in +Inf).
_MAX_TOKEN_BUCKET = 100_000


def _one_two_five(limit: int) -> tuple[float, ...]:
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


_TOKEN_BUCKETS = _one_two_five(_MAX_TOKEN_BUCKET)

# Sluice's outcome of a stream -> vLLM's ``finished_reason``.
_FINISHED_REASONS = {
    "stop": "stop",
    "tool_calls": "stop",
    "length": "length",
    "cancelled": "abort",
    "client_gone": "abort",
    "error": "error",
}
FINISHED_REASONS = ("stop", "length", "abort", "error")


def finished_reason(outcome: str) -> str:
    """vLLM's ``finished_reason`` for a stream's outcome (an unknown one passes as is)."""
    return _FINISHED_REASONS.get(outcome, outcome)


@dataclass(frozen=True, slots=True)
class VllmSeries:
    """One model's children of every stream-observed ``vllm:`` family (looked up once)."""

    ttft: Histogram
    itl: LoopHistogramChild
    time_per_output_token: LoopHistogramChild
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram
    inference: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    request_max_num_generation_tokens: Histogram
    prompt_tokens: Counter
    generation_tokens: LoopCounterChild
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    success: dict[str, Counter]


class VllmFamilies:
    """The stream-observed ``vllm:`` families of one registry, and their per-model children.

    Every served model's series exist from the start, at zero (as vLLM's do): the
    dashboard's model list is filled before the first request.
    """

    def __init__(self, registry: CollectorRegistry, versions: dict[str, str]) -> None:
        self._versions = versions

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=buckets)

        def counter(name: str, doc: str, labels: tuple[str, ...] = LABELS) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self._ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS
        )

        def per_token_histogram(name: str, doc: str, buckets: tuple[float, ...]) -> LoopHistogram:
            return LoopHistogram(name, doc, LABELS, registry=registry, buckets=buckets)

        self._itl = per_token_histogram(
            "vllm:inter_token_latency_seconds", "Gap between token appends", _ITL_BUCKETS
        )
        self._tpot = per_token_histogram(
            "vllm:time_per_output_token_seconds",
            "Gap between token appends (the older name of vllm:inter_token_latency_seconds)",
            _ITL_BUCKETS,
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Time from creation to the end", _REQUEST_BUCKETS
        )
        self._queue = histogram(
            "vllm:request_queue_time_seconds",
            "Time until the backend admitted the request",
            _REQUEST_BUCKETS,
        )
        self._prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Time from admission to the first token",
            _REQUEST_BUCKETS,
        )
        self._decode = histogram(
            "vllm:request_decode_time_seconds",
            "Time from the first token to the last",
            _REQUEST_BUCKETS,
        )
        self._inference = histogram(
            "vllm:request_inference_time_seconds",
            "Time from admission to the last token",
            _REQUEST_BUCKETS,
        )
        self._request_prompt = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a request", _TOKEN_BUCKETS
        )
        self._request_generation = histogram(
            "vllm:request_generation_tokens", "Generated tokens of a request", _TOKEN_BUCKETS
        )
        self._request_max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Generated tokens of the longest sequence of a request (one sequence here)",
            _TOKEN_BUCKETS,
        )
        self._prompt = counter("vllm:prompt_tokens", "Prompt tokens of ended requests")
        self._generation = LoopCounter(
            "vllm:generation_tokens", "Generated tokens", LABELS, registry=registry
        )
        self._queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self._hits = counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache")
        self._success = counter(
            "vllm:request_success", "Ended requests", (*LABELS, "finished_reason")
        )
        self._series: dict[str, VllmSeries] = {}
        for model in versions:
            self.series(model)

    def series(self, model: str) -> VllmSeries:
        """``model``'s children (made on first use for a model not known at the start)."""
        found = self._series.get(model)
        if found is not None:
            return found
        labels = (model, self._versions.get(model, ""))
        made = VllmSeries(
            ttft=self._ttft.labels(*labels),
            itl=self._itl.labels(*labels),
            time_per_output_token=self._tpot.labels(*labels),
            e2e=self._e2e.labels(*labels),
            queue=self._queue.labels(*labels),
            prefill=self._prefill.labels(*labels),
            decode=self._decode.labels(*labels),
            inference=self._inference.labels(*labels),
            request_prompt_tokens=self._request_prompt.labels(*labels),
            request_generation_tokens=self._request_generation.labels(*labels),
            request_max_num_generation_tokens=self._request_max_generation.labels(*labels),
            prompt_tokens=self._prompt.labels(*labels),
            generation_tokens=self._generation.labels(*labels),
            prefix_cache_queries=self._queries.labels(*labels),
            prefix_cache_hits=self._hits.labels(*labels),
            success={reason: self._success.labels(*labels, reason) for reason in FINISHED_REASONS},
        )
        self._series[model] = made
        return made

    def success(self, model: str, outcome: str) -> Counter:
        """The ``vllm:request_success`` child a stream of ``model`` that ended with
        ``outcome`` counts in."""
        reason = finished_reason(outcome)
        child = self.series(model).success.get(reason)
        if child is None:  # an outcome this module does not know yet
            child = self._success.labels(model, self._versions.get(model, ""), reason)
        return child
