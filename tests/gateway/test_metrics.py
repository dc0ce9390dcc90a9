"""``GET /metrics``: Prometheus text that moves as streams start, stream tokens, end for each
reason, get refused and resume; the gaps between SSE writes of tokens; the time an engine
request's cancel takes to free its KV blocks; engine gauges per model."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sluice.sse import Decoder
from tests.rawhttp import open_get
from tests.server import ServerProcess, wait_for_state


def scrape(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


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
    assert ("sluice_engine_preemptions", (("model", "sluice-tiny"),)) in after


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
