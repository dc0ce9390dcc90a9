"""Reads of another replica's stream while Redis cannot mirror it for this one.

A replica serves a stream another one runs by looking up its record (``HGETALL``), then
following it: a subscription to its channel and an ``XRANGE`` of its log. When the record
is readable but the subscription is down (Redis timed out the replica's reconnect, as it
can under load), every read path answers as creations do when Redis is gone: ``503`` with
``Retry-After`` and the JSON error body (an SSE read its ``retry:`` hint, a WebSocket an
``error`` message), never a ``500``. A long-poll held when the subscription breaks
answers empty from its cursor (the server asked its reader to go), and the next read
follows the stream again once Redis answers.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest
import redis

from tests.rawhttp import open_get
from tests.scaleout.replicas import read_sse, replicas, retrying, wait_until
from tests.server import ServerProcess
from tests.transports.wsclient import open_ws, receive, send_json

# Several processes start per test (seconds each on a loaded machine).
pytestmark = pytest.mark.timeout(240)

_USERS = itertools.count()
_UNAVAILABLE = "the shared stream registry (Redis) is unavailable"
_TEXT = " ".join(f"w{i}" for i in range(2000))


def create(server: ServerProcess, interval_ms: float = 20) -> str:
    """A stream of 2,000 words, one every ``interval_ms``: live for the whole test."""
    body = {"model": "words", "prompt": _TEXT, "interval_ms": interval_ms}
    response = httpx.post(f"{server.base_url}/v1/streams", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


@pytest.fixture
def unfollowing_url(redis_url: str) -> Iterator[str]:
    """``redis_url`` as a Redis user who may run every command but the ones that follow a
    stream (``SUBSCRIBE`` and ``XRANGE``): a replica on it reads the registry, but its
    subscription never comes up, as while Redis refuses or times out its reconnect."""
    user, password = f"unfollowing-{next(_USERS)}", "secret"
    denied = ("-subscribe", "-psubscribe", "-ssubscribe", "-xrange")
    with redis.Redis.from_url(redis_url) as admin:
        admin.execute_command(
            "ACL", "SETUSER", user, "reset", "on", f">{password}", "~*", "&*", "+@all", *denied
        )
        try:
            yield redis_url.replace("redis://", f"redis://{user}:{password}@", 1)
        finally:
            admin.execute_command("ACL", "DELUSER", user)


def poll(server: ServerProcess, after: str, timeout_s: float = 0) -> httpx.Response:
    stream_id = after.rsplit(":", 1)[0]
    params = {"after": after, "timeout_s": str(timeout_s)}
    return httpx.get(f"{server.base_url}/v1/streams/{stream_id}/poll", params=params, timeout=90)


def describe(server: ServerProcess, stream_id: str) -> dict[str, object]:
    url = f"{server.base_url}/v1/streams/{stream_id}"
    described: dict[str, object] = retrying(partial(httpx.get, url), "describe").json()
    return described


def assert_refused(answer: httpx.Response, error: dict[str, str]) -> None:
    assert answer.status_code == 503, answer.text
    assert int(answer.headers["Retry-After"]) >= 1
    assert answer.json() == {"error": error}


def test_every_read_of_a_stream_the_replica_cannot_follow_is_a_503_with_retry_after(
    redis_url: str, unfollowing_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "reader-replica.log"
    with (
        replicas(redis_url, 1) as (owner,),
        ServerProcess("--no-model", "--redis", unfollowing_url, stderr_path=log) as reader,
    ):
        reader.wait_ready()
        # The state the replica is in: Redis answers it, its subscription does not come up.
        wait_until(lambda: "Redis subscription lost" in log.read_text(), "a lost subscription")
        stream_id = create(owner)
        base = f"{reader.base_url}/v1/streams/{stream_id}"
        overloaded = {"type": "overloaded_error", "code": "overloaded", "message": _UNAVAILABLE}

        assert_refused(httpx.get(f"{base}/poll", params={"after": f"{stream_id}:0"}), overloaded)
        assert_refused(httpx.get(base), overloaded)
        durable = httpx.get(
            f"{reader.base_url}/v1/ds/streams/{stream_id}",
            params={"offset": "-1", "live": "long-poll"},
        )
        assert_refused(durable, {"code": "overloaded", "message": _UNAVAILABLE})

        # An SSE resume gets the transient refusal of SSE reads: a 200 whose body is only a
        # retry: hint (EventSource stops reconnecting on any other status).
        last_event_id = {"Last-Event-ID": f"{stream_id}:1"}
        resumed = open_get(reader.port, f"/v1/streams/{stream_id}/events", last_event_id)
        try:
            assert resumed.status == 200
            hint = resumed.sized_body()
        finally:
            resumed.close()
        assert re.fullmatch(rb"retry: ?\d+\n\n", hint), hint
        # The scale-out tests' SSE reader takes it for "come back later", as EventSource
        # does: it asks again from the same Last-Event-ID, then gives up at its deadline.
        with pytest.raises(AssertionError, match=f"after {stream_id}:1 \\(only a retry: hint"):
            read_sse(reader, f"/v1/streams/{stream_id}/events", f"{stream_id}:1", timeout_s=1)

        with open_ws(reader) as ws:
            send_json(ws, {"type": "subscribe", "stream_id": stream_id, "last_event_id": None})
            refused = receive(ws)
        assert refused == {
            "type": "error", "code": "overloaded", "message": _UNAVAILABLE, "stream_id": stream_id
        }  # fmt: skip


def test_a_poll_held_when_the_subscription_breaks_answers_empty_and_the_next_follows_again(
    redis_url: str,
) -> None:
    """The held poll answers ``200`` with no events, not ``404``: the replica dropped its
    mirror, not the stream. The stream stays known to the replica a while (its reader was
    there), and the next poll mirrors it again instead of finding no log."""
    with replicas(redis_url, 2) as (owner, reader), ThreadPoolExecutor(1) as pool:
        stream_id = create(owner, interval_ms=60_000)  # a token a minute: a poll is held
        start = f"{stream_id}:0"
        # Before the break, a 503 + Retry-After is asked again (the subscription can drop
        # for a moment on a loaded machine); the held poll's own answer is taken as it is.
        polled = partial(retrying, partial(poll, reader, start), f"poll {start}")
        wait_until(lambda: len(polled().json()["events"]) == 2, "the first token")
        first = polled()  # start, the first token, then a minute of nothing
        assert first.status_code == 200, first.text
        held = pool.submit(poll, reader, first.json()["next"], timeout_s=60)
        wait_until(lambda: describe(reader, stream_id)["readers"] == 1, "the poll is held")
        with redis.Redis.from_url(redis_url) as admin:
            assert admin.client_kill_filter(_type="pubsub") >= 1
        # The held poll answers empty, from the same cursor: its client polls again.
        interrupted = held.result(timeout=30)
        assert interrupted.status_code == 200, interrupted.text
        assert interrupted.json() == {"events": [], "next": first.json()["next"], "done": False}
        # 503 + Retry-After until the replica's subscription is back (a quarter second),
        # asked again as a client does; then the events.
        again = polled()
        assert again.status_code == 200, again.text
        assert again.json()["events"] == first.json()["events"]
