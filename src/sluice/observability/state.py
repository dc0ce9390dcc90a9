"""Series read from each model's state when ``/metrics`` is scraped.

The embedded engines' ``stats()`` are a snapshot of numbers kept elsewhere (on the engine
thread): queue lengths and KV blocks now, and cumulative counts since the engine started.
:class:`StateCollector` holds the last snapshot and exports it as families built at
collection: gauges for what is now, counters for what is cumulative (so ``rate()`` and
``increase()`` handle a restart's reset), under Sluice's names (``model``) and vLLM's
(``model_name``, ``model_version``).

A backend without an engine (``words``, an upstream) has no engine stats; its
``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` are its live streams the
backend admitted and those waiting for it to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.observability.vllm import LABELS as VLLM_LABELS

__all__ = ["ModelState", "StateCollector"]

# Engine stats exported as Sluice gauges (name -> help), then as Sluice counters.
_ENGINE_GAUGES = {
    "running": "Sequences the engine runs",
    "waiting": "Sequences waiting for the engine",
    "kv_blocks": "KV-cache blocks in all",
    "kv_blocks_used": "KV-cache blocks held by sequences",
    "threads": "Torch threads the engine's steps run on (tuned with --engine-threads auto)",
    "spec_decode_acceptance_pct": "Drafted tokens the target accepted, in percent",
    "spec_decode_k": "Tokens drafted per sequence in the last step (0: speculation off)",
}
_ENGINE_COUNTERS = {
    "prefix_hits": "Prompt blocks served from the prefix cache since the engine started",
    "preemptions": "Sequences preempted (recomputed later) since the engine started",
    "spec_decode_drafts": "Sequence-steps that drafted tokens (speculative decoding)",
    "spec_decode_draft_tokens": "Tokens drafted for the target to verify",
    "spec_decode_accepted_tokens": "Drafted tokens the target accepted",
}
# Speculative decoding under vLLM's names (vllm/v1/spec_decode/metrics.py): stat -> help.
_SPEC_DECODE_COUNTERS = {
    "spec_decode_drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts"),
    "spec_decode_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens"),
    "spec_decode_accepted_tokens": (
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens",
    ),
}
_ACCEPTED_PER_POS = "spec_decode_accepted_tokens_pos_"


@dataclass(frozen=True, slots=True)
class ModelState:
    """What one model is doing at a scrape: its engine's stats, if it has an engine, or
    else the counts of its live streams."""

    engine: Mapping[str, int] | None = None
    num_streams_running: int = 0
    num_streams_waiting: int = 0


class StateCollector(Collector):
    """Exports the last :meth:`update`'s state of every model."""

    def __init__(self, versions: Mapping[str, str]) -> None:
        self._versions = dict(versions)
        self._states: dict[str, ModelState] = {}

    def update(self, states: Mapping[str, ModelState]) -> None:
        """Replace the snapshot (one assignment: a concurrent collection sees one or the
        other)."""
        self._states = dict(states)

    def describe(self) -> Iterable[Metric]:
        return self._families({})

    def collect(self) -> Iterable[Metric]:
        return self._families(self._states)

    def _families(self, states: Mapping[str, ModelState]) -> list[Metric]:
        engine_gauges = {
            name: GaugeMetricFamily(f"sluice_engine_{name}", doc, labels=("model",))
            for name, doc in _ENGINE_GAUGES.items()
        }
        engine_counters = {
            name: CounterMetricFamily(f"sluice_engine_{name}", doc, labels=("model",))
            for name, doc in _ENGINE_COUNTERS.items()
        }
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests being generated", labels=VLLM_LABELS
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting to be generated", labels=VLLM_LABELS
        )
        kv_usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "Fraction of the KV-cache blocks in use (1 means all)",
            labels=VLLM_LABELS,
        )
        # The name vLLM had before vllm:kv_cache_usage_perc, which its dashboard still reads.
        gpu_usage = GaugeMetricFamily(
            "vllm:gpu_cache_usage_perc",
            "Fraction of the KV-cache blocks in use (the older name of vllm:kv_cache_usage_perc)",
            labels=VLLM_LABELS,
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Sequences preempted since the start", labels=VLLM_LABELS
        )
        spec_counters = {
            stat: CounterMetricFamily(name, doc, labels=VLLM_LABELS)
            for stat, (name, doc) in _SPEC_DECODE_COUNTERS.items()
        }
        accepted_per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft's positions",
            labels=(*VLLM_LABELS, "position"),
        )
        for model, state in states.items():
            labels = [model, self._versions.get(model, "")]
            stats = state.engine
            if stats is None:
                running.add_metric(labels, state.num_streams_running)
                waiting.add_metric(labels, state.num_streams_waiting)
                continue
            for name, family in engine_gauges.items():
                if name in stats:
                    family.add_metric([model], stats[name])
            for name, counter in engine_counters.items():
                if name in stats:
                    counter.add_metric([model], stats[name])
            running.add_metric(labels, stats.get("running", 0))
            waiting.add_metric(labels, stats.get("waiting", 0))
            num_blocks = stats.get("kv_blocks", 0)
            if num_blocks > 0:
                fraction = stats.get("kv_blocks_used", 0) / num_blocks
                kv_usage.add_metric(labels, fraction)
                gpu_usage.add_metric(labels, fraction)
            if "preemptions" in stats:
                preemptions.add_metric(labels, stats["preemptions"])
            for stat, counter in spec_counters.items():
                if stat in stats:
                    counter.add_metric(labels, stats[stat])
            for stat, value in stats.items():
                if stat.startswith(_ACCEPTED_PER_POS):
                    # vLLM numbers positions from 0.
                    position = int(stat.removeprefix(_ACCEPTED_PER_POS)) - 1
                    accepted_per_pos.add_metric([*labels, str(position)], value)
        return [
            *engine_gauges.values(),
            *engine_counters.values(),
            running,
            waiting,
            kv_usage,
            gpu_usage,
            preemptions,
            *spec_counters.values(),
            accepted_per_pos,
        ]
