"""Chaos: three ``sluice serve --redis`` gateways behind nginx (round-robin, no stickiness,
default buffering), clients that resume as EventSource does (and the openai SDK over
sluice.client's resuming transport), and processes killed under them. Every text must come out exact: 0 events lost, 0 doubled, exactly one terminal.

The scenarios, in the issue's order of priority: a killed gateway that served a client;
a cancel on another gateway; a killed producer; a SIGTERM under 50 live streams; a Redis
restart; 1,000 streams whose readers move between gateways.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import httpx2
import openai
import orjson
import pytest
from playwright.sync_api import Browser

from sluice.client import ResumeSettings, ResumingTransport
from sluice.sse import Decoder, Event
from tests.redis_server import RedisServer
from tests.scaleout.nginx import Nginx
from tests.scaleout.replicas import (
    event_seqs,
    kill,
    kv_blocks_used,
    read_resuming,
    replicas,
    retrying,
    text_of,
    wait_until,
)
from tests.server import ServerProcess, wait_for_state

# Three gateways, nginx and the clients start per test (a minute on a loaded machine).
pytestmark = pytest.mark.timeout(300)

# A 3 s lease: short enough for the tests, long enough for a loaded machine's heartbeats.
_OPTIONS = ("--retry", "100", "--producer-lease", "3")


@contextlib.contextmanager
def balanced(
    tmp_path: Path, redis_url: str, *options: str, engine: bool = False
) -> Iterator[tuple[list[ServerProcess], Nginx]]:
    with (
        replicas(redis_url, 3, *_OPTIONS, *options, engine=engine) as gateways,
        Nginx(tmp_path, [g.port for g in gateways]) as nginx,
    ):
        yield gateways, nginx


def create(server: ServerProcess, text: str, interval_ms: int = 20) -> str:
    body = {"model": "words", "prompt": text, "interval_ms": interval_ms}
    response = httpx.post(f"{server.base_url}/v1/streams", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def words(count: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}é" for i in range(count))


def readers_on(server: ServerProcess, stream_id: str) -> int:
    try:
        url = f"{server.base_url}/v1/streams/{stream_id}"
        described = retrying(partial(httpx.get, url, timeout=5), "its readers").json()
    except httpx.HTTPError:
        return 0
    return int(described.get("readers", 0))


def assert_exact(events: list[Event], text: str) -> None:
    seqs = event_seqs(events)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # none lost, none doubled
    assert seqs[0] == 1
    terminals = [e for e in events if e.event in ("done", "error")]
    assert [(e.event, orjson.loads(e.data)) for e in terminals] == [("done", {"reason": "stop"})]
    assert text_of(events) == text


# Records what the page's EventSource sees: every event's id, the text, the terminal.
_OPEN = """url => {
    const seen = {ids: [], text: "", done: [], errors: 0, opens: 0};
    const es = new EventSource(url);
    es.onopen = () => { seen.opens += 1; };
    for (const name of ["start", "usage"]) {
        es.addEventListener(name, (ev) => { seen.ids.push(ev.lastEventId); });
    }
    es.addEventListener("token", (ev) => {
        seen.ids.push(ev.lastEventId);
        seen.text += JSON.parse(ev.data).text;
    });
    es.addEventListener("done", (ev) => {
        seen.ids.push(ev.lastEventId);
        seen.done.push(JSON.parse(ev.data).reason);
        es.close();
    });
    es.onerror = () => { seen.errors += 1; };
    window.seen = seen;
}"""


def reader_off_producer(
    producer: ServerProcess, others: list[ServerProcess], stream_id: str
) -> ServerProcess:
    """The gateway (not the producer) that serves the stream's one reader, once there is
    one: a reader on the producer is moved (the server drops its connection and the
    client comes back through nginx, to the next gateway)."""

    def elsewhere() -> bool:
        if any(readers_on(g, stream_id) for g in others):
            return True
        if readers_on(producer, stream_id):
            httpx.post(f"{producer.base_url}/v1/streams/{stream_id}/drop")
        return False

    wait_until(elsewhere, "a reader on a gateway that does not run the stream")
    return next(g for g in others if readers_on(g, stream_id))


def kill_mid_stream(victim: ServerProcess, producer: ServerProcess, stream_id: str) -> None:
    kill(victim)
    described = httpx.get(f"{producer.base_url}/v1/streams/{stream_id}").json()
    assert described["state"] == "running"  # it was killed mid-stream


# A public model that is the words backend paced like a slow model, so that a compatible
# request (which has no interval_ms) streams for seconds.
_PACED = """
[[alias]]
name = "paced"
rollout = "manual"
[[alias.version]]
name = "v1"
model = "words"
weight = 100
stable = true
interval_ms = 25
"""


class _StreamIdOf(httpx2.HTTPTransport):
    """Under the SDK's resuming transport: tells the stream id of the first answer, and
    counts the reads that resumed it."""

    def __init__(self) -> None:
        super().__init__()
        self.stream_id: str | None = None
        self.known = threading.Event()
        self.num_resumes = 0

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        self.num_resumes += request.method == "GET"
        response = super().handle_request(request)
        if not self.known.is_set():
            self.stream_id = response.headers.get("x-sluice-stream-id")
            self.known.set()
        return response


def read_with_the_openai_sdk(base_url: str, text: str, inner: _StreamIdOf) -> str:
    """The ``openai`` SDK, unchanged but for its ``http_client``: a resumable chat stream
    through nginx, carried across dropped connections by sluice.client."""
    transport = ResumingTransport(inner, ResumeSettings(initial_delay_s=0.1))
    with openai.OpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    ) as client:
        stream = client.chat.completions.create(
            model="paced",
            messages=[{"role": "user", "content": text}],
            stream=True,
            extra_headers={"X-Sluice-Resumable": "true"},
        )
        chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    contents = [c.choices[0].delta.content for c in chunks if c.choices]
    assert len([c for c in contents if c]) == len(text.split())  # one chunk a word, no double
    return "".join(c or "" for c in contents)


@pytest.mark.browser
def test_1_killing_the_gateway_serving_a_client_mid_stream_loses_and_doubles_nothing(
    tmp_path: Path, redis_url: str, browser: Browser
) -> None:
    """Three clients, each of its own stream run by one gateway and read through nginx on
    another: Chromium's EventSource, a plain client that resumes with Last-Event-ID, and
    the openai SDK on a resumable chat stream. The gateways serving them are killed; all
    three come back through nginx elsewhere."""
    models = tmp_path / "models.toml"
    models.write_text(_PACED)
    with balanced(tmp_path, redis_url, "--models-config", str(models)) as (gateways, nginx):
        sdk_text = words(300, tag="o")  # 7.5 s
        sdk: dict[str, str] = {}
        stream_id_of = _StreamIdOf()
        sdk_client = threading.Thread(
            target=lambda: sdk.setdefault(
                "text", read_with_the_openai_sdk(nginx.base_url, sdk_text, stream_id_of)
            )
        )
        sdk_client.start()
        assert stream_id_of.known.wait(timeout=30)
        sdk_stream = stream_id_of.stream_id
        assert sdk_stream is not None
        # The gateway nginx gave the SDK's request runs its stream; it runs the others too.
        wait_until(lambda: any(readers_on(g, sdk_stream) for g in gateways), "the SDK reads")
        producer = next(g for g in gateways if readers_on(g, sdk_stream))
        others = [g for g in gateways if g is not producer]
        page_text, raw_text = words(300), words(300, tag="x")
        page_stream = create(producer, page_text, interval_ms=25)  # 7.5 s
        raw_stream = create(producer, raw_text, interval_ms=25)
        page = browser.new_page()
        page.set_default_timeout(60_000)
        page.goto(f"{nginx.base_url}/")
        page.evaluate(_OPEN, f"/v1/streams/{page_stream}/events")
        page_gateway = reader_off_producer(producer, others, page_stream)
        sdk_gateway = reader_off_producer(producer, others, sdk_stream)
        moves: list[int] = []
        raw: dict[str, list[Event]] = {}
        target = f"/v1/streams/{raw_stream}/events"
        client = threading.Thread(
            target=lambda: raw.setdefault(
                "events", read_resuming(nginx.port, target, moved=lambda: moves.clear())
            )
        )
        client.start()
        raw_gateway = reader_off_producer(producer, others, raw_stream)
        moves.append(1)  # cleared by the client's next reconnection
        victims = {g.port: g for g in (page_gateway, raw_gateway, sdk_gateway)}
        for victim in victims.values():
            kill_mid_stream(victim, producer, page_stream)
        page.wait_for_function("window.seen.done.length > 0")
        seen = page.evaluate("window.seen")
        assert seen["opens"] >= 2  # it reconnected, through nginx, to a live gateway
        seqs = [int(i.rsplit(":", 1)[1]) for i in seen["ids"]]
        assert seqs == list(range(1, len(seqs) + 1))
        assert seen["text"] == page_text
        assert seen["done"] == ["stop"]
        client.join(timeout=60)
        assert not client.is_alive()
        assert not moves  # it reconnected after the kill
        assert_exact(raw["events"], raw_text)
        sdk_client.join(timeout=60)
        assert not sdk_client.is_alive()
        assert sdk["text"] == sdk_text
        assert stream_id_of.num_resumes >= 2  # moved off the producer, then off the victim


def test_3_cancel_on_one_gateway_stops_the_generation_on_another_and_frees_kv(
    tmp_path: Path, redis_url: str
) -> None:
    with balanced(tmp_path, redis_url, engine=True) as (gateways, nginx):
        a, b = gateways[0], gateways[1]
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 240,
            "temperature": 1.0,
            "ignore_eos": True,
        }
        response = httpx.post(f"{a.base_url}/v1/streams", json=body)
        assert response.status_code == 201, response.text
        stream_id = str(response.json()["id"])
        target = f"/v1/streams/{stream_id}/events"
        reading: dict[str, list[Event]] = {}
        reader = threading.Thread(
            target=lambda: reading.setdefault("events", read_resuming(nginx.port, target))
        )
        reader.start()
        wait_until(lambda: kv_blocks_used(a) > 0, "the engine runs the stream")
        cancel = partial(httpx.post, f"{b.base_url}/v1/streams/{stream_id}/cancel")
        assert retrying(cancel, "b cancels a's stream").status_code == 202
        wait_for_state(a, stream_id, "cancelled")
        wait_until(lambda: kv_blocks_used(a) == 0, "the engine freed its KV blocks")
        reader.join(timeout=30)
        assert not reader.is_alive()
        events = reading["events"]
        done = [orjson.loads(e.data) for e in events if e.event == "done"]
        assert done == [{"reason": "cancelled"}]
        assert (
            orjson.loads(next(e for e in events if e.event == "usage").data)["completion_tokens"]
            < 240
        )


def test_2_killing_the_producer_ends_every_reader_with_one_retryable_error(
    tmp_path: Path, redis_url: str
) -> None:
    with balanced(tmp_path, redis_url) as (gateways, nginx):
        producer = gateways[0]
        stream_id = create(producer, words(3000), interval_ms=20)
        target = f"/v1/streams/{stream_id}/events"
        results: list[list[Event]] = []
        readers = [
            threading.Thread(target=lambda: results.append(read_resuming(nginx.port, target)))
            for _ in range(4)
        ]
        for thread in readers:
            thread.start()
        wait_until(lambda: sum(readers_on(g, stream_id) for g in gateways) == 4, "four readers")
        kill(producer)
        for thread in readers:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a reader hung"
        assert len(results) == 4
        for events in results:
            seqs = event_seqs(events)
            assert seqs == list(range(1, len(seqs) + 1))
            terminals = [e for e in events if e.event in ("done", "error")]
            assert [e.event for e in terminals] == ["error"]
            error = orjson.loads(terminals[0].data)
            assert error["retryable"] is True
            assert error["code"] == "unavailable"


def test_5_sigterm_under_50_live_streams_moves_their_clients_and_completes_each(
    tmp_path: Path, redis_url: str
) -> None:
    # Its 50 streams are created before their readers start (seconds on a loaded
    # machine): a grace window that outlasts that, and a drain that outlasts the streams.
    with balanced(tmp_path, redis_url, "--grace", "120", "--drain-timeout", "90") as (
        gateways,
        nginx,
    ):
        texts = [words(500, tag=f"s{n}.") for n in range(50)]  # 20 s each
        ids = [create(gateways[n % 3], text, interval_ms=40) for n, text in enumerate(texts)]
        results: dict[int, list[Event]] = {}

        def read(n: int) -> None:
            results[n] = read_resuming(nginx.port, f"/v1/streams/{ids[n]}/events")

        threads = [threading.Thread(target=read, args=(n,)) for n in range(50)]
        for thread in threads:
            thread.start()
        terminated = gateways[2]
        wait_until(
            lambda: sum(readers_on(terminated, stream_id) for stream_id in ids) >= 5,
            "the gateway to stop serves readers",
            timeout_s=30,
        )
        own = [ids[n] for n in range(2, 50, 3)]  # the streams it runs
        running = [httpx.get(f"{terminated.base_url}/v1/streams/{i}").json() for i in own]
        assert any(described["state"] == "running" for described in running)
        kill(terminated, signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a reader hung"
        for n, text in enumerate(texts):
            assert_exact(results[n], text)
        assert terminated.process is not None
        assert terminated.process.wait(timeout=30) == 0


def test_4_a_redis_restart_mid_stream_ends_each_stream_exactly_or_with_one_retryable_error(
    tmp_path: Path,
) -> None:
    with RedisServer(tmp_path, appendonly=True) as own_redis:
        (tmp_path / "lb").mkdir()
        with balanced(tmp_path / "lb", own_redis.url) as (gateways, nginx):
            texts = [words(80, tag=f"r{n}.") for n in range(10)]
            ids = [create(gateways[n % 3], t, interval_ms=25) for n, t in enumerate(texts)]
            results: dict[int, list[Event]] = {}

            def read(n: int) -> None:
                results[n] = read_resuming(nginx.port, f"/v1/streams/{ids[n]}/events")

            threads = [threading.Thread(target=read, args=(n,)) for n in range(10)]
            for thread in threads:
                thread.start()
            wait_until(
                lambda: (
                    all(readers_on(gateways[n % 3], ids[n]) >= 0 for n in range(10))
                    and httpx.get(f"{gateways[0].base_url}/v1/streams/{ids[0]}").json()["events"]
                    > 10
                ),
                "the streams run",
            )
            own_redis.restart()
            for thread in threads:
                thread.join(timeout=60)
                assert not thread.is_alive(), "a stream hung"
        outcomes = set()
        for n, text in enumerate(texts):
            events = results[n]
            seqs = event_seqs(events)
            assert seqs == list(range(1, len(seqs) + 1)), n  # none lost, none doubled
            terminals = [e for e in events if e.event in ("done", "error")]
            assert len(terminals) == 1, n
            if terminals[0].event == "done":
                assert text_of(events) == text
                outcomes.add("complete")
            else:
                assert orjson.loads(terminals[0].data)["retryable"] is True
                assert text.startswith(text_of(events))
                outcomes.add("retryable_error")
        assert outcomes


async def _read_moving(client: httpx.AsyncClient, url: str, rng: random.Random) -> list[Event]:
    """Read a stream through nginx, leaving after a few events each time and coming back
    with Last-Event-ID (round-robin sends each connection to another gateway)."""
    events: list[Event] = []
    last_id: str | None = None
    for _ in range(100):
        headers = {"Last-Event-ID": last_id} if last_id else {}
        cut = rng.randint(3, 10)
        got = 0
        async with client.stream("GET", url, headers=headers) as response:
            if response.status_code == 204:
                return events
            assert response.status_code == 200, response.status_code
            decoder = Decoder()
            async for piece in response.aiter_raw():
                for event in decoder.feed(piece):
                    events.append(event)
                    last_id = event.id or last_id
                    got += 1
                    if event.event in ("done", "error"):
                        return events
                if got >= cut:
                    break
    raise AssertionError(f"{url}: never ended")


@pytest.mark.timeout(900)
def test_6_a_thousand_streams_whose_readers_move_between_gateways_are_all_exact(
    tmp_path: Path, redis_url: str
) -> None:
    """1,000 streams created through nginx (so spread over the gateways), then read 200 at
    a time by readers that leave after a few events and come back through nginx."""
    num_streams, num_readers = 1000, 200
    with balanced(tmp_path, redis_url, "--grace", "120") as (_, nginx):

        async def run() -> None:
            limits = httpx.Limits(max_connections=num_readers, max_keepalive_connections=0)
            timeout = httpx.Timeout(60.0, pool=None)
            async with httpx.AsyncClient(
                base_url=nginx.base_url, limits=limits, timeout=timeout
            ) as client:
                texts = [words(12, tag=f"t{n}.") for n in range(num_streams)]
                room = asyncio.Semaphore(num_readers)

                async def start(n: int) -> str:
                    async with room:
                        body = {"model": "words", "prompt": texts[n], "interval_ms": 50}
                        created = await client.post("/v1/streams", json=body)
                    assert created.status_code == 201, created.text
                    return f"/v1/streams/{created.json()['id']}/events"

                urls = await asyncio.gather(*(start(n) for n in range(num_streams)))

                async def read(n: int) -> list[Event]:
                    async with room:
                        return await _read_moving(client, urls[n], random.Random(n))

                results = await asyncio.gather(*(read(n) for n in range(num_streams)))
                for n, events in enumerate(results):
                    assert_exact(events, texts[n])

        # In a thread of its own: the module's Playwright (sync API) keeps an event loop
        # running in this one.
        failure: list[BaseException] = []

        def main() -> None:
            try:
                asyncio.run(run())
            except BaseException as exc:  # handed to the test below
                failure.append(exc)

        thread = threading.Thread(target=main)
        thread.start()
        thread.join()
        if failure:
            raise failure[0]
