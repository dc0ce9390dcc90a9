"""Metric families for the per-token series, observed on the event loop without locks.

A token delta is observed in six series (inter-token latency three times under its
Sluice and ``vllm:`` names, two token counters, and the SSE write gap). With
``prometheus_client``'s own families each observation takes two locks and walks the
bucket list in Python; at tens of thousands of tokens a second that was a tenth of a
proxy hop's CPU. These families hold plain numbers instead: an observation is one
``bisect`` and two additions.

The rule that makes that safe: **only the event loop's thread observes them** (the hub
and the delivery layer run there). A scrape may read them from another thread (the
exposition is encoded off the loop): it copies each child's counts in one step, so a
scrape sees every observation or none of it, give or take one in flight between the
count and the sum, as with ``prometheus_client``'s own histograms. Series observed from
other threads (the engine's abort timings) keep ``prometheus_client``'s families.

They expose exactly what the library's families of the same name, labels and buckets
expose (without ``_created``), and register in a ``CollectorRegistry`` like them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["LoopCounter", "LoopHistogram"]

Child = TypeVar("Child")


class LoopHistogramChild:
    """One label set's buckets: ``counts[i]`` observations in bucket ``i`` (not
    cumulative; the last is ``+Inf``), and their sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.sum += amount
        # The first bucket whose upper bound is >= amount (Prometheus's ``le``).
        self.counts[bisect_left(self._bounds, amount)] += 1


class LoopCounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class _Family(Collector, Generic[Child]):
    """A labelled family: its children by label values, registered as a collector."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        registry.register(self)

    def labels(self, *values: str) -> Child:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, not {values}")
        key = tuple(str(value) for value in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def _new_child(self) -> Child:
        raise NotImplementedError

    def _items(self) -> list[tuple[tuple[str, ...], Child]]:
        return list(self._children.items())  # one step: safe beside the loop adding one

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopHistogram(_Family[LoopHistogramChild]):
    """A histogram family (``_bucket``, ``_count``, ``_sum``) observed on the loop only."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = tuple(float(bound) for bound in buckets if bound != float("inf"))
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}'s buckets must increase: {buckets}")
        self._bounds = bounds
        # The library's own spelling of ``le`` (untyped there).
        les = [floatToGoString(bound) for bound in bounds]  # type: ignore[no-untyped-call]
        self._les: list[str] = [*les, "+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> LoopHistogramChild:
        return LoopHistogramChild(self._bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key, child in self._items():
            counts = list(child.counts)  # one step, then the sum
            total = child.sum
            cumulative: list[tuple[str, float]] = []
            running = 0
            for le, count in zip(self._les, counts, strict=True):
                running += count
                cumulative.append((le, running))
            family.add_metric(list(key), cumulative, total)
        return [family]


class LoopCounter(_Family[LoopCounterChild]):
    """A counter family (``_total``) incremented on the loop only."""

    def _new_child(self) -> LoopCounterChild:
        return LoopCounterChild()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key, child in self._items():
            family.add_metric(list(key), child.value)
        return [family]
