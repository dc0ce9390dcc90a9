"""Overload against a real server: past a limit, every request is either served completely
or refused with 429/503 + Retry-After before any body, and none hangs; clients that leave
at any point (queued, prefill, decode) leave no engine request or KV block behind."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from sluice.sse import Decoder
from tests.server import ServerProcess

NUM_TENANT_STREAMS = 4


@pytest.fixture(scope="module")
def tenant_limited() -> Iterator[ServerProcess]:
    options = ["--max-streams-per-tenant", str(NUM_TENANT_STREAMS)]
    with ServerProcess("--no-model", "--grace", "2", *options) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="module")
def engine_server() -> Iterator[ServerProcess]:
    """The bundled model with 2 running sequences and 8 waiting: a capacity of 10."""
    with ServerProcess("--max-running", "2", "--grace", "2") as server:
        server.wait_ready()
        yield server


def run_all(jobs: list[Callable[[], None]], timeout_s: float = 120.0) -> None:
    """Run every job in its own thread at once; each must end (no hang) without raising."""
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not thread.is_alive(), "a request hung"
    if errors:
        raise errors[0]


def assert_refused(response: httpx.Response, statuses: tuple[int, ...]) -> None:
    """A refusal before any body: the status, ``Retry-After``, an error in JSON."""
    assert response.status_code in statuses, response.text
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["message"]


def test_tenant_over_its_stream_limit_is_refused_before_any_body(
    tenant_limited: ServerProcess,
) -> None:
    server = tenant_limited
    words = [f"w{i}" for i in range(10)]
    outcomes: list[str] = []

    def one() -> None:
        body = {"prompt": " ".join(words), "interval_ms": 100, "resumable": False}
        created = httpx.post(f"{server.base_url}/v1/streams", json=body, timeout=30)
        if created.status_code != 201:
            assert_refused(created, (429,))  # the tenant limit, not the server
            outcomes.append("refused")
            return
        decoder = Decoder()
        url = f"{server.base_url}{created.json()['events_url']}"
        with httpx.stream("GET", url, timeout=30) as response:
            events = [e for piece in response.iter_raw() for e in decoder.feed(piece)]
        text = "".join(json.loads(e.data)["text"] for e in events if e.event == "token")
        assert text.split() == words
        assert events[-1].event == "done"
        outcomes.append("served")

    run_all([one] * (3 * NUM_TENANT_STREAMS))
    assert outcomes.count("served") >= 1
    assert outcomes.count("refused") >= 1
    assert len(outcomes) == 3 * NUM_TENANT_STREAMS
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'sluice_admission_refusals_total{reason="tenant_limit"}' in metrics


def chat(server: ServerProcess, max_tokens: int) -> tuple[str, dict[str, object]]:
    body = {
        "messages": [{"role": "user", "content": "What does socket.connect do?"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    return f"{server.base_url}/v1/chat/completions", body


def test_three_times_the_engine_capacity_is_served_or_refused_with_retry_after(
    engine_server: ServerProcess,
) -> None:
    outcomes: list[str] = []

    def one() -> None:
        url, body = chat(engine_server, 48)
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            if response.status_code != 200:
                response.read()
                assert_refused(response, (503,))
                outcomes.append("refused")
                return
            data = [e.data for piece in response.iter_raw() for e in Decoder().feed(piece)]
        text = "".join(data)
        assert data[-1] == "[DONE]", text[-200:]
        assert '"finish_reason":"length"' in text or '"finish_reason":"stop"' in text
        outcomes.append("served")

    run_all([one] * 30)
    assert len(outcomes) == 30
    # The waiting queue's 8 at least, and every one whole: a burst that comes within one
    # engine step meets an empty running set (its 2 slots fill at the next step).
    assert outcomes.count("served") >= 8
    assert outcomes.count("refused") >= 1  # 30 at once cannot all fit in 2 + 8


TTFT_SLO_S = 2.0
# The objective's engine: 8 running sequences and, as ``sluice serve`` sizes its queue
# (4 waiting per running sequence), 32 waiting.
SLO_MAX_RUNNING = 8
SLO_MAX_WAITING = 4 * SLO_MAX_RUNNING
# Every served request holds its slot this long: with the prompt's 19 tokens, all of the
# model's 256 positions but a few.
SLO_MAX_TOKENS = 224


@pytest.fixture(scope="module")
def slo_server() -> Iterator[ServerProcess]:
    """The bundled model with 8 running sequences and a 2 s objective on time to first
    token. A tenth of the objective is kept for the client, whose threads share the CPU."""
    options = ["--max-running", str(SLO_MAX_RUNNING), "--ttft-slo", str(TTFT_SLO_S)]
    with ServerProcess(*options, "--ttft-headroom", "0.2", "--grace", "2") as server:
        server.wait_ready()
        yield server


@pytest.mark.timeout(180)  # a 224-token wave of 8 takes 10-30 s on a loaded 2-vCPU machine
def test_requests_over_the_ttft_objective_are_refused_and_the_accepted_start_in_time(
    slo_server: ServerProcess,
) -> None:
    """As many requests at once as the engine's waiting queue holds (so however they meet
    the engine's steps, the queue never refuses one: the objective is the only limit they
    meet), each holding its slot for 224 tokens, so that the last would wait 3 turns of
    224 steps, over the objective unless a step of 8 sequences takes under 1.8 ms (3-15 ms
    on a 2-vCPU machine): each request is refused for the objective (503 + Retry-After,
    before any body) or served whole, its first token within the SLO as the client
    measures it."""
    ttfts_s: list[float] = []
    refusals: list[str] = []
    # One client for all: each of httpx's top-level calls makes a client, and its TLS
    # context (tens of ms of CPU) would count as time to first token.
    limits = httpx.Limits(max_connections=SLO_MAX_WAITING)
    http = httpx.Client(timeout=60, limits=limits)

    def one() -> None:
        url, body = chat(slo_server, SLO_MAX_TOKENS)
        body["ignore_eos"] = True  # every served request holds its slot for all its tokens
        sent = time.monotonic()
        with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                response.read()
                assert_refused(response, (503,))
                refusals.append(response.json()["error"]["message"])
                return
            decoder, first_token_at = Decoder(), None
            data: list[str] = []
            for piece in response.iter_raw():
                for event in decoder.feed(piece):
                    data.append(event.data)
                    text = '"content":"' in event.data and '"content":""' not in event.data
                    if first_token_at is None and text:
                        first_token_at = time.monotonic()
        assert data[-1] == "[DONE]"
        assert first_token_at is not None
        ttfts_s.append(first_token_at - sent)

    with http:
        run_all([one] * SLO_MAX_WAITING)
    assert len(ttfts_s) + len(refusals) == SLO_MAX_WAITING
    assert len(ttfts_s) >= SLO_MAX_RUNNING  # an idle engine starts the first ones at once
    assert refusals, "32 x 224 tokens through 8 slots cannot all start within 2 s"
    assert all("objective" in message for message in refusals), refusals
    assert max(ttfts_s) <= TTFT_SLO_S, sorted(ttfts_s)
    metrics = httpx.get(f"{slo_server.base_url}/metrics").text
    refused = [line for line in metrics.splitlines() if 'reason="ttft_slo"' in line]
    assert refused[0].startswith("sluice_backend_refusals_total{")
    assert float(refused[0].rsplit(" ", 1)[1]) == len(refusals)
    assert 'reason="queue_full"' not in metrics


def engine_stats(server: ServerProcess) -> dict[str, int]:
    engines: dict[str, dict[str, int]] = httpx.get(f"{server.base_url}/readyz").json()["engines"]
    (stats,) = engines.values()
    return stats


@pytest.mark.timeout(240)
def test_clients_leaving_at_random_points_leave_no_engine_request_or_block(
    engine_server: ServerProcess,
) -> None:
    initial = engine_stats(engine_server)
    rng = random.Random(5)
    url, body = chat(engine_server, 64)
    raw = json.dumps(body).encode()

    def leave_while_queued() -> None:
        """Send the request and hang up before the response starts."""
        with socket.create_connection(("127.0.0.1", engine_server.port)) as sock:
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
            )
            sock.sendall(head.encode() + raw)

    def leave_after(num_pieces: int) -> Callable[[], None]:
        def job() -> None:
            with httpx.stream("POST", url, json=body, timeout=60) as response:
                for index, _ in enumerate(response.iter_raw()):
                    if index >= num_pieces:
                        break

        return job

    jobs: list[Callable[[], None]] = []
    for _ in range(200):  # the count
        choice = rng.random()
        if choice < 0.3:
            jobs.append(leave_while_queued)
        else:
            jobs.append(leave_after(rng.randrange(0, 12)))
    for start in range(0, len(jobs), 20):
        run_all(jobs[start : start + 20])
    deadline = time.monotonic() + 30
    while (stats := engine_stats(engine_server)) != initial | {
        k: v for k, v in stats.items() if k not in ("running", "waiting", "kv_blocks_used")
    }:
        assert time.monotonic() < deadline, (stats, initial)
        time.sleep(0.05)  # polling an observable condition with a deadline
    assert stats["running"] == stats["waiting"] == 0
    assert stats["kv_blocks_used"] == initial["kv_blocks_used"]
