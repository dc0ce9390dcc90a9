"""Replicas on one Redis (``sluice serve --redis``): any replica serves any stream.

Every test runs real ``sluice serve`` processes and a real ``redis-server`` on 127.0.0.1,
each test on a database of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import orjson
import pytest

from sluice.sse import Decoder
from tests.redis_server import RedisServer
from tests.scaleout.replicas import (
    kill,
    kv_blocks_used,
    read_sse,
    replicas,
    retrying,
    text_of,
    wait_until,
)
from tests.server import ServerProcess, wait_for_state

# Several processes start per test (seconds each on a loaded machine).
pytestmark = pytest.mark.timeout(240)


def create(server: ServerProcess, text: str, **more: object) -> dict[str, object]:
    body = {"model": "words", "prompt": text, "interval_ms": 10, **more}
    response = httpx.post(f"{server.base_url}/v1/streams", json=body)
    assert response.status_code == 201, response.text
    created: dict[str, object] = response.json()
    return created


def words(count: int) -> str:
    return " ".join(f"w{i}é" for i in range(count))


def test_a_stream_created_on_one_replica_resumes_on_another_with_the_exact_text(
    redis_url: str,
) -> None:
    with replicas(redis_url, 2) as (a, b):
        text = words(80)
        stream_id = create(a, text)["id"]
        target = f"/v1/streams/{stream_id}/events"
        first = read_sse(a, target, max_events=20)
        assert not first.ended
        assert first.last_id is not None
        rest = read_sse(b, target, first.last_id)
        assert rest.ended
        events = first.events + rest.events
        ids = [int(str(e.id).rsplit(":", 1)[1]) for e in events if e.id]
        assert ids == list(range(1, len(ids) + 1))  # none lost, none doubled
        assert text_of(events) == text
        assert [e.event for e in events].count("done") == 1
        # And from the start, on the replica that does not run it.
        assert text_of(read_sse(b, target).events) == text


def test_status_and_cancel_on_another_replica_stop_the_producer(redis_url: str) -> None:
    with replicas(redis_url, 2) as (a, b):
        stream_id = create(a, words(2000), interval_ms=20)["id"]
        url = f"{b.base_url}/v1/streams/{stream_id}"
        status = retrying(partial(httpx.get, url), "b describes the stream")
        assert status.status_code == 200
        assert status.json()["model"] == "words"
        cancelled = retrying(partial(httpx.post, f"{url}/cancel"), "b cancels the stream")
        assert cancelled.status_code == 202
        wait_for_state(a, stream_id, "cancelled")
        events = read_sse(b, f"/v1/streams/{stream_id}/events").events
        done = [orjson.loads(e.data) for e in events if e.event == "done"]
        assert done == [{"reason": "cancelled"}]
        assert len(text_of(events).split()) < 2000
        assert retrying(partial(httpx.get, url), "b describes it").json()["state"] == "cancelled"


def test_cancel_on_another_replica_frees_the_engines_kv_blocks(redis_url: str) -> None:
    with replicas(redis_url, 2, engine=True) as (a, b):
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 240,
            "temperature": 1.0,
            "ignore_eos": True,
        }
        created = httpx.post(f"{a.base_url}/v1/streams", json=body)
        assert created.status_code == 201, created.text
        stream_id = created.json()["id"]
        target = f"/v1/streams/{stream_id}/events"
        assert read_sse(b, target, max_events=3).events  # it runs
        cancel = partial(httpx.post, f"{b.base_url}/v1/streams/{stream_id}/cancel")
        assert retrying(cancel, "b cancels the stream").status_code == 202
        described = wait_for_state(a, stream_id, "cancelled")
        assert described["finish_reason"] == "cancelled"
        wait_until(lambda: kv_blocks_used(a) == 0, "the engine freed the stream's KV blocks")


def test_a_reader_on_another_replica_keeps_a_resumable_stream_past_its_grace(
    redis_url: str,
) -> None:
    """Nobody reads it on the replica that runs it: a reader elsewhere is enough."""
    with replicas(redis_url, 2, "--grace", "0.5") as (a, b):
        text = words(60)
        stream_id = create(a, text, interval_ms=30)["id"]  # ~2 s, four grace windows
        read = read_sse(b, f"/v1/streams/{stream_id}/events")
        assert read.ended
        assert text_of(read.events) == text
        done = [orjson.loads(e.data) for e in read.events if e.event == "done"]
        assert done == [{"reason": "stop"}]


def test_a_stream_nobody_reads_anywhere_is_still_cancelled_after_its_grace(
    redis_url: str,
) -> None:
    with replicas(redis_url, 2, "--grace", "0.5") as (a, b):
        stream_id = create(a, words(1000), interval_ms=20)["id"]
        read_sse(b, f"/v1/streams/{stream_id}/events", max_events=3)  # then leaves
        described = wait_for_state(a, stream_id, "cancelled")
        assert described["finish_reason"] == "cancelled"


def test_killing_the_producer_gives_every_reader_one_retryable_error_within_the_lease(
    redis_url: str,
) -> None:
    with replicas(redis_url, 3, "--producer-lease", "1") as (a, b, c):
        stream_id = create(a, words(2000), interval_ms=20)["id"]
        target = f"/v1/streams/{stream_id}/events"
        reads: dict[str, list[str]] = {}

        def follow(server: ServerProcess, name: str) -> None:
            reads[name] = [e.event for e in read_sse(server, target).events]

        followers = [
            threading.Thread(target=follow, args=(server, name))
            for server, name in ((b, "b"), (c, "c"))
        ]
        for thread in followers:
            thread.start()
        wait_until(lambda: kv_free_or_tokens(b, stream_id), "b's reader got tokens")
        kill(a)
        for thread in followers:
            thread.join(timeout=15)
            assert not thread.is_alive(), "a reader hung"
        for name, events in reads.items():
            assert events.count("error") == 1, name
            assert events[-1] == "error", name
            assert "done" not in events, name
        final = read_sse(b, target).events
        error = orjson.loads(final[-1].data)
        assert final[-1].event == "error"
        assert error["retryable"] is True
        assert error["code"] == "unavailable"
        assert [e.event for e in final].count("error") == 1
        status = retrying(partial(httpx.get, f"{c.base_url}/v1/streams/{stream_id}"), "c's status")
        assert status.json()["state"] == "failed"


def kv_free_or_tokens(server: ServerProcess, stream_id: object) -> bool:
    url = f"{server.base_url}/v1/streams/{stream_id}"
    described = retrying(partial(httpx.get, url), "the stream's status").json()
    return int(described["events"]) > 3


def test_killing_a_replica_that_only_serves_readers_loses_nothing(redis_url: str) -> None:
    with replicas(redis_url, 3) as (a, b, c):
        text = words(100)
        stream_id = create(a, text, interval_ms=10)["id"]
        target = f"/v1/streams/{stream_id}/events"
        first = read_sse(b, target, max_events=25)
        kill(b)
        rest = read_sse(c, target, first.last_id)
        assert text_of(first.events + rest.events) == text


def test_a_resume_token_made_by_one_replica_verifies_on_another(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replicas share the token secret through Redis (no --token-secret given)."""
    monkeypatch.setenv("SLUICE_API_KEYS", "acme:key-acme-0123456789")
    with replicas(redis_url, 2) as (a, b):
        text = words(30)
        response = httpx.post(
            f"{a.base_url}/v1/streams",
            json={"model": "words", "prompt": text},
            headers={"Authorization": "Bearer key-acme-0123456789"},
        )
        assert response.status_code == 201, response.text
        events_url = str(response.json()["events_url"])
        read = read_sse(b, events_url)  # no key: the token alone
        assert read.status == 200
        assert text_of(read.events) == text
        stream_id = response.json()["id"]
        assert read_sse(b, f"/v1/streams/{stream_id}/events").status == 401


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path, appendonly=True) as server:
        yield server


def test_with_redis_gone_new_streams_are_refused_at_once_and_live_ones_end(
    own_redis: RedisServer,
) -> None:
    with replicas(own_redis.url, 1) as (a,):
        stream_id = create(a, words(3000), interval_ms=20)["id"]
        target = f"/v1/streams/{stream_id}/events"
        live: dict[str, list[str]] = {}

        def follow() -> None:
            live["events"] = [e.event for e in read_sse(a, target).events]

        reader = threading.Thread(target=follow)
        reader.start()
        wait_until(lambda: kv_free_or_tokens(a, stream_id), "the stream runs")
        own_redis.stop()
        refused = httpx.post(
            f"{a.base_url}/v1/streams", json={"model": "words", "prompt": "x"}, timeout=10
        )
        assert refused.status_code == 503
        assert refused.headers["Retry-After"]
        reader.join(timeout=15)
        assert not reader.is_alive(), "a live stream hung with Redis gone"
        assert live["events"][-1] == "error"
        assert live["events"].count("error") == 1


def test_a_compatible_stream_resumes_on_another_replica_in_its_dialect(redis_url: str) -> None:
    """OpenAI chat completions with ``X-Sluice-Resumable``: resuming on the other replica
    from any frame gives exactly the frames after it, as chat.completion.chunk frames."""
    with replicas(redis_url, 2) as (a, b):
        body = {
            "model": "words",
            "messages": [{"role": "user", "content": "one two  three four"}],
            "stream": True,
        }
        response = httpx.post(
            f"{a.base_url}/v1/chat/completions",
            json=body,
            headers={"X-Sluice-Resumable": "true"},
        )
        assert response.status_code == 200
        stream_id = response.headers["x-sluice-stream-id"]
        frames = Decoder().feed(response.content)
        assert len(frames) >= 6
        events_path = f"/v1/streams/{stream_id}/events"
        for i, frame in enumerate(frames):
            rest = read_sse(b, events_path, frame.id).events
            assert frames[: i + 1] + rest == frames, f"resumed on b after frame {i}"


def test_long_poll_on_another_replica_reads_the_whole_stream(redis_url: str) -> None:
    with replicas(redis_url, 2) as (a, b):
        text = words(40)
        stream_id = create(a, text)["id"]
        url = f"{b.base_url}/v1/streams/{stream_id}/poll"
        after = f"{stream_id}:0"
        received: list[dict[str, object]] = []
        for _ in range(200):
            # The same cursor again after a 503 + Retry-After (Redis out for a moment).
            polled = retrying(partial(httpx.get, url, params={"after": after}), f"poll {after}")
            if polled.status_code == 204:
                break
            assert polled.status_code == 200, polled.text
            batch = polled.json()
            received.extend(batch["events"])
            after = str(batch["next"])
            if batch.get("done"):
                break
        tokens = [e["data"]["text"] for e in received if e["event"] == "token"]
        assert "".join(tokens) == text


def test_a_durable_streams_read_on_another_replica_follows_the_whole_generation(
    redis_url: str,
) -> None:
    """``/v1/ds/streams/{id}`` on the replica that does not run the stream: long-polls from
    the start until ``Stream-Closed``, every event once and in order."""
    with replicas(redis_url, 2) as (a, b):
        text = words(40)
        stream_id = create(a, text)["id"]
        url = f"{b.base_url}/v1/ds/streams/{stream_id}"
        offset, messages = "-1", []
        for _ in range(200):
            query = {"offset": offset, "live": "long-poll"}
            answer = retrying(partial(httpx.get, url, params=query, timeout=30), f"read {offset}")
            assert answer.status_code in (200, 204), answer.text
            if answer.status_code == 200:
                messages.extend(answer.json())
            offset = answer.headers["stream-next-offset"]
            if answer.headers.get("stream-closed") == "true":
                break
        ids = [int(str(m["id"]).rsplit(":", 1)[1]) for m in messages]
        assert ids == list(range(1, len(ids) + 1))
        assert "".join(m["data"]["text"] for m in messages if m["event"] == "token") == text
        assert messages[-1]["event"] == "done"


def test_a_client_written_durable_stream_lives_in_the_redis_log_of_its_replica(
    redis_url: str,
) -> None:
    """The write side on a ``--redis`` replica: appends of any bytes go through the Redis
    log's encoding and read back exactly."""
    with replicas(redis_url, 1) as (a,):
        url = f"{a.base_url}/v1/ds/notes"
        octets = {"content-type": "application/octet-stream"}
        assert httpx.put(url, headers=octets).status_code == 201
        chunks = [bytes(range(256)), b"\x00\xff tail"]
        for chunk in chunks:
            assert httpx.post(url, content=chunk, headers=octets).status_code in (200, 204)
        whole = httpx.get(url, params={"offset": "-1"})
        assert whole.status_code == 200
        assert whole.content == b"".join(chunks)
