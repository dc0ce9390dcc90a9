"""The lock-free per-token families expose exactly what prometheus_client's own do."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from sluice.observability.exposition import Registry
from sluice.observability.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)
LABELS = ("model", "model_version")
amounts = st.lists(
    st.floats(min_value=0, max_value=100, allow_nan=False) | st.sampled_from(BUCKETS), max_size=40
)


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


@given(amounts, amounts)
def test_a_histogram_exposes_what_prometheus_clients_does(
    first: list[float], second: list[float]
) -> None:
    theirs, ours = Registry(), Registry()
    reference = Histogram("h_seconds", "doc", LABELS, registry=theirs, buckets=BUCKETS)
    loop = LoopHistogram("h_seconds", "doc", LABELS, registry=ours, buckets=BUCKETS)
    for labels, values in ((("a", "1"), first), (("b", ""), second)):
        for value in values:
            reference.labels(*labels).observe(value)
            loop.labels(*labels).observe(value)
    assert exposition(ours) == exposition(theirs)


@given(st.lists(st.integers(min_value=0, max_value=10**6), max_size=20))
def test_a_counter_exposes_what_prometheus_clients_does(increments: list[int]) -> None:
    theirs, ours = Registry(), Registry()
    reference = Counter("tokens", "doc", LABELS, registry=theirs)
    loop = LoopCounter("tokens", "doc", LABELS, registry=ours)
    reference.labels("m", "v")
    loop.labels("m", "v")
    for amount in increments:
        reference.labels("m", "v").inc(amount)
        loop.labels("m", "v").inc(amount)
    assert exposition(ours) == exposition(theirs)


def test_a_counter_refuses_to_go_down_and_labels_must_match() -> None:
    counter = LoopCounter("tokens", "doc", LABELS, registry=Registry())
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("m", "v").inc(-1)
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("m")


def test_a_name_is_registered_once() -> None:
    registry = Registry()
    LoopHistogram("h_seconds", "doc", LABELS, registry=registry, buckets=BUCKETS)
    with pytest.raises(ValueError, match="Duplicated"):
        Histogram("h_seconds", "doc", LABELS, registry=registry, buckets=BUCKETS)
