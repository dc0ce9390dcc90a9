"""``GET /metrics``: Prometheus text that moves as streams start, stream tokens, end for each
reason, get refused and resume; the gaps between SSE writes of tokens; the time an engine
request's cancel takes to free its KV blocks; engine gauges and counters per model; the
same body as OpenMetrics when asked for, with no ``_created`` series; refusals that are not
also counted as ended streams; the ``vllm:`` series a vLLM Grafana dashboard reads."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from sluice.sse import Decoder
from tests.rawhttp import open_get
from tests.server import ServerProcess, wait_for_state

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
CORES = len(os.sched_getaffinity(0))  # the servers' too: they run here

# Every series the panels of vLLM's Grafana dashboard query, each filtered on
# {model_name="$model_name"} (vllm-project/vllm, examples/online_serving/prometheus_grafana/
# grafana.json at commit 004f771f3a6b49597546b05c7d83686d1e121fa0); its model variable is
# label_values({__name__=~"vllm:.*"}, model_name).
DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
# The current names vLLM exports (vllm/v1/metrics/loggers.py) beside the dashboard's.
CURRENT_VLLM_SERIES = (
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)
# What needs a KV cache: a backend without one (``words``) has none of it.
KV_CACHE_SERIES = {
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
}


@pytest.fixture(scope="module")
def quiet_server() -> Iterator[ServerProcess]:
    """A server of this module's own: no other test's stream ends while one here counts."""
    with ServerProcess() as server:
        yield server.wait_ready()


def families(server: ServerProcess, accept: str | None = None) -> tuple[list[Metric], str]:
    """The parsed families of one scrape (OpenMetrics when ``accept`` asks for it, with
    prometheus-client's OpenMetrics parser) and the content type."""
    headers = {} if accept is None else {"Accept": accept}
    response = httpx.get(f"{server.base_url}/metrics", headers=headers)
    assert response.status_code == 200
    content_type = response.headers["content-type"]
    if content_type.startswith("application/openmetrics-text"):
        return list(openmetrics_families(response.text)), content_type
    return list(text_string_to_metric_families(response.text)), content_type


def flatten(found: Iterable[Metric]) -> Samples:
    samples = {}
    for family in found:
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def scrape(server: ServerProcess) -> Samples:
    found, content_type = families(server)
    assert content_type.startswith("text/plain")
    return flatten(found)


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_streams_refusals_and_resumes(server: ServerProcess) -> None:
    before = scrape(server)
    words = {"model": "words", "model_version": ""}
    tiny = {"model": "sluice-tiny"}
    # stop, length (the model), cancelled, client_gone, a refusal, a resume
    created = httpx.post(
        f"{server.base_url}/v1/streams", json={"model": "words", "prompt": "a b c"}
    ).json()
    httpx.get(f"{server.base_url}{created['events_url']}")
    body = {"prompt": "Return the", "max_tokens": 4, "temperature": 0}
    model_stream = httpx.post(f"{server.base_url}/v1/streams", json=body).json()
    raw = httpx.get(f"{server.base_url}{model_stream['events_url']}", timeout=30).content
    assert Decoder().feed(raw)[-1].event == "done"
    slow = httpx.post(
        f"{server.base_url}/v1/streams",
        json={"model": "words", "prompt": "w " * 500, "interval_ms": 50},
    ).json()
    httpx.post(f"{server.base_url}{slow['cancel_url']}")
    wait_for_state(server, slow["id"], "cancelled")
    gone = httpx.post(
        f"{server.base_url}/v1/streams",
        json={"model": "words", "prompt": "w " * 500, "interval_ms": 50, "resumable": False},
    ).json()
    response = open_get(server.port, str(gone["events_url"]))
    next(iter(response.body()))
    response.close()
    wait_for_state(server, gone["id"], "cancelled")
    assert (
        httpx.post(
            f"{server.base_url}/v1/streams", json={"model": "nope", "prompt": "x"}
        ).status_code
        == 404
    )
    resumed = open_get(
        server.port, str(created["events_url"]), {"Last-Event-ID": f"{created['id']}:2"}
    )
    b"".join(resumed.body())
    resumed.close()

    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("sluice_streams_finished_total", **words, reason="stop") >= 1
    assert moved("sluice_streams_finished_total", **words, reason="cancelled") >= 1
    assert moved("sluice_streams_finished_total", **words, reason="client_gone") >= 1
    assert moved("sluice_admission_refusals_total", reason="unknown_model") >= 1
    assert moved("sluice_resumes_total") >= 1
    assert moved("sluice_tokens_total", **words) >= 3
    assert moved("sluice_time_to_first_token_seconds_count", **words) >= 3
    tiny_finished = [
        dict(labels)
        for name, labels in after
        if name == "sluice_streams_finished_total" and dict(labels)["model"] == "sluice-tiny"
    ]
    assert tiny_finished
    assert all(len(labels["model_version"]) == 12 for labels in tiny_finished)
    tiny_version = {"model": "sluice-tiny", "model_version": tiny_finished[0]["model_version"]}
    assert moved("sluice_streams_finished_total", **tiny_version, reason="length") >= 1
    # four tokens, one engine step each: a first token and gaps (a token that ends
    # inside a UTF-8 character releases no text: hence at least two)
    assert moved("sluice_time_to_first_token_seconds_count", **tiny_version) >= 1
    assert moved("sluice_inter_token_latency_seconds_count", **tiny_version) >= 2
    assert value(after, "sluice_engine_kv_blocks", **tiny) > 0
    assert value(after, "sluice_engine_running", **tiny) == 0
    # the engine's child process tunes its threads (--engine-threads auto): one of its two
    assert value(after, "sluice_engine_threads", **tiny) in {max(1, CORES - 1), CORES}
    assert ("sluice_engine_preemptions_total", (("model", "sluice-tiny"),)) in after


def test_sse_writes_of_tokens_observe_the_gaps_between_them(server: ServerProcess) -> None:
    """One observation per write after the first that carries tokens: a paced stream of
    five tokens is at least two writes (each token its own write unless the server fell
    behind), and the gaps add up to no more than the stream lasted."""
    before = scrape(server)
    words = {"model": "words", "model_version": ""}
    started = time.monotonic()
    response = open_get(server.port, "/v1/demo/words?text=a%20b%20c%20d%20e&interval_ms=30")
    events = Decoder().feed(b"".join(response.body()))
    elapsed_s = time.monotonic() - started
    response.close()
    assert [e.event for e in events].count("token") == 5
    after = scrape(server)
    count = value(after, "sluice_sse_inter_event_gap_seconds_count", **words) - value(
        before, "sluice_sse_inter_event_gap_seconds_count", **words
    )
    total_s = value(after, "sluice_sse_inter_event_gap_seconds_sum", **words) - value(
        before, "sluice_sse_inter_event_gap_seconds_sum", **words
    )
    assert 1 <= count <= 4
    assert 0 < total_s <= elapsed_s


def test_cancelling_an_engine_stream_observes_the_time_until_its_blocks_are_free(
    server: ServerProcess,
) -> None:
    before = scrape(server)
    body = {"prompt": "Return the", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    created = httpx.post(f"{server.base_url}/v1/streams", json=body).json()
    response = open_get(server.port, str(created["events_url"]))
    decoder = Decoder()
    for piece in response.body():  # until the first token: the request is in the engine
        if any(event.event == "token" for event in decoder.feed(piece)):
            break
    httpx.post(f"{server.base_url}{created['cancel_url']}")
    response.close()
    wait_for_state(server, created["id"], "cancelled")
    after = scrape(server)
    name = "sluice_cancel_to_kv_free_seconds_count"
    assert value(after, name, model="sluice-tiny") - value(before, name, model="sluice-tiny") >= 1


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, got), v in samples.items() if n == name and wanted <= set(got))


def read_stream(server: ServerProcess, body: dict[str, object]) -> dict[str, dict[str, object]]:
    """Create a native stream, read it to its end; its events' data by event name."""
    created = httpx.post(f"{server.base_url}/v1/streams", json=body, timeout=30)
    assert created.status_code == 201, created.text
    raw = httpx.get(f"{server.base_url}{created.json()['events_url']}", timeout=60).content
    events = Decoder().feed(raw)
    assert events[-1].event == "done"
    return {event.event: json.loads(event.data) for event in events if event.event}


def test_metrics_are_prometheus_text_or_openmetrics_as_asked_without_created_series(
    quiet_server: ServerProcess,
) -> None:
    """Both of prometheus-client's parsers accept what they asked for; the two bodies hold
    the same series; cumulative engine counts are counters."""
    text, text_type = families(quiet_server)
    assert text_type.startswith("text/plain; version=0.0.4")
    openmetrics, openmetrics_type = families(quiet_server, OPENMETRICS)
    assert openmetrics_type.startswith("application/openmetrics-text; version=1.0.0")
    for found in (text, openmetrics):
        types = {family.name: family.type for family in found}
        for name in (
            "sluice_engine_prefix_hits",
            "sluice_engine_preemptions",
            "sluice_streams_finished",
            "sluice_tokens",
            "vllm:num_preemptions",
            "vllm:request_success",
            "vllm:prompt_tokens",
        ):
            assert types[name] == "counter", name
        assert types["vllm:num_requests_running"] == "gauge"
        assert types["vllm:time_to_first_token_seconds"] == "histogram"
        names = {sample.name for family in found for sample in family.samples}
        assert not [name for name in names if name.endswith("_created")]
        assert "sluice_engine_preemptions_total" in names
        assert "vllm:num_requests_running" in names  # the colon survives OpenMetrics too
    assert set(flatten(text)) == set(flatten(openmetrics))


def test_a_refused_request_counts_as_a_refusal_and_not_as_an_ended_stream(
    quiet_server: ServerProcess,
) -> None:
    """The engine refuses these in ``start()`` (400: over its context length) on the native
    and the OpenAI paths; the words demo refuses before any stream exists. None of them is
    an ended stream, an end-to-end time, or a vLLM request."""
    server = quiet_server
    before = scrape(server)
    too_long = {"prompt": "Return the", "max_tokens": 1000}
    native = httpx.post(f"{server.base_url}/v1/streams", json=too_long, timeout=30)
    assert native.status_code == 400, native.text
    assert "max_model_len" in native.json()["error"]["message"]
    chat = {
        "model": "sluice-tiny",
        "messages": [{"role": "user", "content": "Return the"}],
        "max_tokens": 1000,
        "stream": True,
    }
    compat = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=30)
    assert compat.status_code == 400, compat.text
    demo = httpx.get(f"{server.base_url}/v1/demo/words", params={"text": "a", "interval_ms": -1})
    assert demo.status_code == 400, demo.text
    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("sluice_admission_refusals_total", reason="invalid_request") == 2
    assert moved("sluice_streams_finished_total") == 0
    assert moved("sluice_e2e_seconds_count") == 0
    assert moved("sluice_streams_active") == 0
    assert moved("vllm:request_success_total") == 0
    assert moved("vllm:e2e_request_latency_seconds_count") == 0
    assert moved("vllm:prompt_tokens_total") == 0


def vllm_labels(samples: Samples, model: str) -> dict[str, str]:
    """The labels of ``model``'s ``vllm:prompt_tokens_total`` (its ``model_version`` too)."""
    for (name, labels), _ in samples.items():
        if name == "vllm:prompt_tokens_total" and dict(labels)["model_name"] == model:
            return dict(labels)
    raise AssertionError(f"no vllm: series for {model}")


def test_vllm_series_follow_an_engine_request_and_a_words_request(
    quiet_server: ServerProcess,
) -> None:
    """Per served model name: the token counts are the usage its client was given, one
    request ended with its reason, and the engine's KV usage is a fraction."""
    server = quiet_server
    served = [model["id"] for model in httpx.get(f"{server.base_url}/v1/models").json()["data"]]
    assert {"sluice-tiny", "words"} <= set(served)
    before = scrape(server)
    engine = read_stream(server, {"prompt": "Return the", "max_tokens": 4, "temperature": 0})
    words = read_stream(server, {"model": "words", "prompt": "one two three four five"})
    after = scrape(server)

    model_names = {dict(labels).get("model_name") for name, labels in after if "vllm:" in name}
    assert model_names == set(served)
    reasons = {"stop": "stop", "length": "length"}
    for model, events in (("sluice-tiny", engine), ("words", words)):
        labels = vllm_labels(after, model)
        assert labels["model_version"] == vllm_labels(before, model)["model_version"]

        def moved(name: str, model: str = model, **more: str) -> float:
            return total(after, name, model_name=model, **more) - total(
                before, name, model_name=model, **more
            )

        usage = events["usage"]
        assert moved("vllm:prompt_tokens_total") == usage["prompt_tokens"] > 0
        assert moved("vllm:request_prompt_tokens_sum") == usage["prompt_tokens"]
        assert moved("vllm:generation_tokens_total") == usage["completion_tokens"] > 0
        assert moved("vllm:request_generation_tokens_sum") == usage["completion_tokens"]
        assert moved("vllm:prefix_cache_queries_total") == usage["prompt_tokens"]
        assert moved("vllm:prefix_cache_hits_total") == usage["cached_tokens"]
        reason = reasons[str(events["done"]["reason"])]
        assert moved("vllm:request_success_total", finished_reason=reason) == 1
        assert moved("vllm:request_success_total") == 1
        assert moved("vllm:e2e_request_latency_seconds_count") == 1
        assert moved("vllm:time_to_first_token_seconds_count") == 1
        assert moved("vllm:request_queue_time_seconds_count") == 1
        assert moved("vllm:request_prefill_time_seconds_count") == 1
        e2e_s = moved("vllm:e2e_request_latency_seconds_sum")
        assert 0 <= moved("vllm:request_inference_time_seconds_sum") <= e2e_s
        assert moved("vllm:request_generation_tokens_count") == 1
        assert total(after, "vllm:num_requests_running", model_name=model) == 0
        assert total(after, "vllm:num_requests_waiting", model_name=model) == 0
    kv_usage = total(after, "vllm:kv_cache_usage_perc", model_name="sluice-tiny")
    assert 0 <= kv_usage <= 1
    used = total(after, "sluice_engine_kv_blocks_used", model="sluice-tiny")
    assert kv_usage == used / total(after, "sluice_engine_kv_blocks", model="sluice-tiny")
    assert total(after, "vllm:gpu_cache_usage_perc", model_name="sluice-tiny") == kv_usage


def test_every_series_the_vllm_dashboard_queries_exists_for_every_served_model(
    quiet_server: ServerProcess,
) -> None:
    """What a vLLM dashboard's panels select, for each model its model list offers."""
    samples = scrape(quiet_server)
    served = [
        model["id"] for model in httpx.get(f"{quiet_server.base_url}/v1/models").json()["data"]
    ]
    for model in served:
        present = {name for name, labels in samples if dict(labels).get("model_name") == model}
        wanted = set(DASHBOARD_SERIES) | set(CURRENT_VLLM_SERIES)
        if model == "words":
            wanted -= KV_CACHE_SERIES
        assert sorted(wanted - present) == [], model
    assert total(samples, "vllm:gpu_cache_usage_perc", model_name="sluice-tiny") >= 0


def test_a_served_process_freezes_its_start_up_objects(quiet_server: ServerProcess) -> None:
    """``sluice serve`` moves what it built before serving (torch, the model, the app) out
    of the collector's reach, so a full collection does not pause every stream for it."""
    frozen = value(scrape(quiet_server), "sluice_gc_frozen_objects")
    assert frozen > 50_000  # a process that imported torch holds about 240,000
