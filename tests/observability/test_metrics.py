"""The metrics observer in-process, fed real :class:`~sluice.streams.hub.Stream` records as
the hub feeds them: what each stream outcome counts in, the token counts taken from the
usage, the phase times, and the exposition in both formats."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from sluice.events import Usage
from sluice.observability.exposition import Registry, encode
from sluice.observability.metrics import Metrics
from sluice.observability.vllm import finished_reason
from sluice.streams.hub import Stream

VERSIONS = {"tiny": "0123456789ab", "words": ""}
TINY = {"model_name": "tiny", "model_version": "0123456789ab"}  # vLLM's labels
SLUICE_TINY = {"model": "tiny", "model_version": "0123456789ab"}  # Sluice's


def new_stream(model: str = "tiny", stream_id: str = "str_1") -> Stream:
    return Stream(id=stream_id, model=model, resumable=True, grace_s=1.0, created=time.time())


def get(metrics: Metrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def run_admitted(
    metrics: Metrics,
    stream: Stream,
    gaps_s: list[float],
    usage: Usage | None,
    outcome: str,
    queued_s: float = 0.0,
) -> None:
    """What the hub tells the observer of a stream admitted ``queued_s`` after its creation
    whose token events (one per gap) come ``gaps_s`` apart (the first: after the creation),
    and which ends 0.1 s after the last."""
    metrics.started(stream, queued_s)
    stream.admitted = True
    for i, gap_s in enumerate(gaps_s):
        metrics.tokens(stream, 1, gap_s, first=i == 0)
        stream.num_tokens += 1
    stream.usage = usage
    metrics.finished(stream, outcome, sum(gaps_s) + 0.1)


def test_a_stream_the_backend_refused_is_in_no_stream_family() -> None:
    """Refused in ``start()`` (a 400 or 503): the gateway counts the refusal, nothing here."""
    metrics = Metrics(VERSIONS)
    stream = new_stream()
    metrics.refused(stream, "queue_full")
    metrics.finished(stream, "error", 0.01)
    assert get(metrics, "sluice_backend_refusals_total", **SLUICE_TINY, reason="queue_full")
    assert get(metrics, "sluice_streams_finished_total", **SLUICE_TINY, reason="error") == 0
    assert get(metrics, "sluice_e2e_seconds_count", **SLUICE_TINY) == 0
    assert get(metrics, "vllm:request_success_total", **TINY, finished_reason="error") == 0
    assert get(metrics, "vllm:e2e_request_latency_seconds_count", **TINY) == 0


def test_a_stream_cancelled_before_admission_ended_as_an_abort() -> None:
    metrics = Metrics(VERSIONS)
    stream = new_stream()
    stream.usage = Usage(prompt_tokens=0, completion_tokens=0)
    metrics.finished(stream, "client_gone", 0.2)
    labels = SLUICE_TINY
    assert get(metrics, "sluice_streams_finished_total", **labels, reason="client_gone") == 1
    assert get(metrics, "sluice_streams_active", **labels) == 0  # never counted active
    assert get(metrics, "vllm:request_success_total", **TINY, finished_reason="abort") == 1
    assert get(metrics, "vllm:request_prefill_time_seconds_count", **TINY) == 0  # no token


def test_token_counts_are_the_usage_topped_up_from_the_live_count() -> None:
    """Three token events for five completion tokens (two tokens released no text): the
    generation total ends at five, counted three live and two at the end."""
    metrics = Metrics(VERSIONS)
    stream = new_stream()
    metrics.started(stream, 0.0)
    stream.admitted = True
    for i in range(3):
        metrics.tokens(stream, 1, 0.01, first=i == 0)
        stream.num_tokens += 1
    assert get(metrics, "vllm:generation_tokens_total", **TINY) == 3  # live
    stream.usage = Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=4)
    metrics.finished(stream, "length", 0.1)
    assert get(metrics, "vllm:generation_tokens_total", **TINY) == 5
    assert get(metrics, "vllm:request_generation_tokens_sum", **TINY) == 5
    assert get(metrics, "vllm:request_max_num_generation_tokens_sum", **TINY) == 5
    assert get(metrics, "vllm:prompt_tokens_total", **TINY) == 7
    assert get(metrics, "vllm:request_prompt_tokens_sum", **TINY) == 7
    assert get(metrics, "vllm:prefix_cache_queries_total", **TINY) == 7
    assert get(metrics, "vllm:prefix_cache_hits_total", **TINY) == 4
    assert get(metrics, "sluice_tokens_total", **SLUICE_TINY) == 3  # events, as before
    assert get(metrics, "vllm:request_success_total", **TINY, finished_reason="length") == 1


def test_a_generation_without_usage_counts_the_tokens_it_streamed() -> None:
    """A backend error ends a stream with no ``Usage``: its streamed tokens still count."""
    metrics = Metrics(VERSIONS)
    run_admitted(metrics, new_stream(), [0.1, 0.1], None, "error")
    assert get(metrics, "vllm:generation_tokens_total", **TINY) == 2
    assert get(metrics, "vllm:prompt_tokens_total", **TINY) == 0
    assert get(metrics, "vllm:request_success_total", **TINY, finished_reason="error") == 1


def test_phase_times_split_the_stream_at_admission_and_at_its_first_and_last_tokens() -> None:
    """Admitted at 0.5 s, tokens at 0.75, 1.0 and 1.5 s."""
    metrics = Metrics(VERSIONS)
    run_admitted(metrics, new_stream(), [0.75, 0.25, 0.5], Usage(3, 3), "stop", queued_s=0.5)
    assert get(metrics, "vllm:request_queue_time_seconds_sum", **TINY) == pytest.approx(0.5)
    assert get(metrics, "vllm:request_prefill_time_seconds_sum", **TINY) == pytest.approx(0.25)
    assert get(metrics, "vllm:request_decode_time_seconds_sum", **TINY) == pytest.approx(0.75)
    assert get(metrics, "vllm:request_inference_time_seconds_sum", **TINY) == pytest.approx(1.0)
    assert get(metrics, "vllm:time_to_first_token_seconds_sum", **TINY) == pytest.approx(0.75)
    assert get(metrics, "vllm:inter_token_latency_seconds_count", **TINY) == 2
    assert get(metrics, "vllm:time_per_output_token_seconds_sum", **TINY) == pytest.approx(0.75)
    assert get(metrics, "vllm:e2e_request_latency_seconds_sum", **TINY) == pytest.approx(1.6)


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [
        ("stop", "stop"),
        ("tool_calls", "stop"),
        ("length", "length"),
        ("cancelled", "abort"),
        ("client_gone", "abort"),
        ("error", "error"),
    ],
)
def test_outcomes_map_to_vllm_finished_reasons(outcome: str, reason: str) -> None:
    assert finished_reason(outcome) == reason


def test_every_served_model_has_its_vllm_series_before_any_request() -> None:
    metrics = Metrics(VERSIONS)
    for model, version in VERSIONS.items():
        labels = {"model_name": model, "model_version": version}
        assert metrics.registry.get_sample_value("vllm:prompt_tokens_total", labels) == 0
        assert (
            metrics.registry.get_sample_value("vllm:e2e_request_latency_seconds_count", labels) == 0
        )


async def engine_stats() -> dict[str, int]:
    return {
        "running": 2,
        "waiting": 1,
        "kv_blocks": 40,
        "kv_blocks_used": 10,
        "prefix_hits": 6,
        "preemptions": 3,
        "decode_step_ms": 12,  # not a series
    }


def render(metrics: Metrics, live: list[Stream], accept: str) -> tuple[str, str]:
    body, content_type = asyncio.run(metrics.render({"tiny": engine_stats}, live, accept))
    return body.decode(), content_type


def test_the_exposition_parses_as_text_and_as_openmetrics_without_created_samples() -> None:
    metrics = Metrics(VERSIONS)
    run_admitted(metrics, new_stream(), [0.1, 0.1], Usage(3, 2), "stop")
    waiting, running = new_stream("words", "str_2"), new_stream("words", "str_3")
    running.admitted = True
    text, text_type = render(metrics, [waiting, running], "")
    assert text_type == "text/plain; version=0.0.4; charset=utf-8"
    openmetrics, openmetrics_type = render(
        metrics, [waiting, running], "application/openmetrics-text"
    )
    assert openmetrics_type == "application/openmetrics-text; version=1.0.0; charset=utf-8"
    assert openmetrics.endswith("# EOF\n")
    for found in (
        list(text_string_to_metric_families(text)),
        list(openmetrics_families(openmetrics)),
    ):
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for f in found for s in f.samples
        }
        types = {f.name: f.type for f in found}
        assert not [name for name, _ in samples if name.endswith("_created")]
        assert types["sluice_engine_prefix_hits"] == types["sluice_engine_preemptions"] == "counter"
        assert types["sluice_engine_running"] == "gauge"
        assert samples[("sluice_engine_prefix_hits_total", (("model", "tiny"),))] == 6
        assert samples[("sluice_engine_preemptions_total", (("model", "tiny"),))] == 3
        tiny = tuple(sorted(TINY.items()))
        words = (("model_name", "words"), ("model_version", ""))
        assert samples[("vllm:num_preemptions_total", tiny)] == 3
        assert samples[("vllm:kv_cache_usage_perc", tiny)] == 0.25
        assert samples[("vllm:gpu_cache_usage_perc", tiny)] == 0.25
        assert samples[("vllm:num_requests_running", tiny)] == 2
        assert samples[("vllm:num_requests_waiting", tiny)] == 1
        assert samples[("vllm:num_requests_running", words)] == 1
        assert samples[("vllm:num_requests_waiting", words)] == 1
        assert not [name for name, _ in samples if "decode_step" in name]


def test_a_registry_of_its_own_leaves_created_out_but_keeps_every_other_sample() -> None:
    plain, trimmed = CollectorRegistry(), Registry()
    for registry in (plain, trimmed):
        Counter("things", "Things", registry=registry).inc()
        Histogram("waits_seconds", "Waits", registry=registry, buckets=(1.0,)).observe(0.5)
    plain_text = encode(plain, "")[0].decode().splitlines()
    trimmed_text = encode(trimmed, "")[0].decode().splitlines()
    assert [line for line in plain_text if "_created" not in line] == trimmed_text
    assert any("_created" in line for line in plain_text)  # what is trimmed exists
