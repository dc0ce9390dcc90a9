"""Replicas on a three-node Redis Cluster (``sluice serve --redis redis+cluster://...``),
and the log-memory budget counted in Redis across replicas (on one Redis and on the
cluster).

Every test runs real ``sluice serve`` processes and real ``redis-server`` nodes on
127.0.0.1 (the session's cluster, flushed per test; see ``tests/redis_cluster.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import httpx
import orjson
import pytest
import redis
from redis.cluster import RedisCluster

from sluice.streams.redis_codec import LEASES_KEY, LIVE_KEY, LOG_BYTES_KEY, log_key
from tests.redis_cluster import RedisClusterServers
from tests.scaleout.replicas import (
    event_seqs,
    read_sse,
    replicas,
    retrying,
    text_of,
    wait_until,
)
from tests.server import ServerProcess, wait_for_state

# Several processes start per test (seconds each on a loaded machine).
pytestmark = pytest.mark.timeout(240)

KEY = "key-acme-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def cluster(redis_cluster: RedisClusterServers) -> RedisClusterServers:
    redis_cluster.flush()
    return redis_cluster


def create(server: ServerProcess, text: str, **more: object) -> httpx.Response:
    body = {"model": "words", "prompt": text, "interval_ms": 10, **more}
    return httpx.post(f"{server.base_url}/v1/streams", json=body, headers=AUTH)


def created_id(response: httpx.Response) -> str:
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def words(count: int) -> str:
    return " ".join(f"w{i}é" for i in range(count))


def test_streams_on_a_cluster_land_on_different_nodes_and_resume_exactly_on_another_replica(
    cluster: RedisClusterServers,
) -> None:
    with replicas(cluster.url, 2) as (a, b):
        text = words(80)
        stream_id = created_id(create(a, text))
        target = f"/v1/streams/{stream_id}/events"
        first = read_sse(a, target, max_events=20)
        assert not first.ended
        rest = read_sse(b, target, first.last_id)
        assert rest.ended
        events = first.events + rest.events
        seqs = event_seqs(events)
        assert seqs == list(range(1, len(seqs) + 1))  # none lost, none doubled
        assert text_of(events) == text
        assert [e.event for e in events].count("done") == 1
        # More streams, from both replicas: each log is on the node that owns its slot,
        # and together they are spread over the nodes.
        others = [created_id(create(server, "a b c")) for server in (a, b) * 6]
        nodes = set()
        with cluster.client() as client:
            for other in [stream_id, *others]:
                key = log_key(other)
                node = client.get_node_from_key(key)
                with redis.Redis(host=node.host, port=node.port) as owner:
                    wait_until(lambda o=owner, k=key: o.exists(k), f"{key} on its node")
                nodes.add(node.name)
            # The registry's keys share one slot, so its scripts are atomic there.
            assert client.keyslot(LEASES_KEY) == client.keyslot(LIVE_KEY)
        assert len(nodes) >= 2


def test_a_cancel_on_another_replica_of_a_cluster_stops_the_producer(
    cluster: RedisClusterServers,
) -> None:
    with replicas(cluster.url, 2) as (a, b):
        stream_id = created_id(create(a, words(2000), interval_ms=20))
        url = f"{b.base_url}/v1/streams/{stream_id}"
        assert retrying(partial(httpx.get, url), "b describes it").json()["model"] == "words"
        assert retrying(partial(httpx.post, f"{url}/cancel"), "b cancels it").status_code == 202
        wait_for_state(a, stream_id, "cancelled")
        events = read_sse(b, f"/v1/streams/{stream_id}/events").events
        done = [orjson.loads(e.data) for e in events if e.event == "done"]
        assert done == [{"reason": "cancelled"}]
        assert len(text_of(events).split()) < 2000


def test_a_tenants_live_streams_are_counted_across_the_replicas_of_a_cluster(
    cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_API_KEYS", f"acme:{KEY}")
    with replicas(cluster.url, 2, "--max-streams-per-tenant", "1") as (a, b):
        stream_id = created_id(create(a, words(2000), interval_ms=20))
        refused = create(b, "x")
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        url = f"{b.base_url}/v1/streams/{stream_id}/cancel"
        cancel = retrying(partial(httpx.post, url, headers=AUTH), "b cancels a's stream")
        assert cancel.status_code == 202
        status = f"{a.base_url}/v1/streams/{stream_id}"
        wait_until(
            lambda: httpx.get(status, headers=AUTH).json()["state"] == "cancelled", "cancelled"
        )
        # Its end takes it out of the tenant's count on every replica.
        wait_until(lambda: create(b, "x").status_code == 201, "b admits the tenant again")


@contextlib.contextmanager
def two_budgets(url: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Replica ``a`` with a large log-memory budget, ``b`` with 256 KiB of it."""
    a = ServerProcess("--redis", url, "--no-model", "--log-memory-budget", "64MiB")
    b = ServerProcess("--redis", url, "--no-model", "--log-memory-budget", "256KiB")
    with a, b:
        a.wait_ready()
        b.wait_ready()
        yield a, b


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_the_log_bytes_of_live_streams_count_in_redis_against_every_replicas_budget(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """``b`` holds nothing itself, but refuses a creation (503, Retry-After) once ``a``'s
    live stream fills ``b``'s budget; the count is back to zero when the streams end."""
    client: redis.Redis | RedisCluster
    if kind == "cluster":
        servers: RedisClusterServers = request.getfixturevalue("cluster")
        url, client = servers.url, servers.client()
    else:
        url = request.getfixturevalue("redis_url")
        client = redis.Redis.from_url(url)
    full_mark = 256 * 1024 * 9 // 10

    def counted() -> int:
        return int(client.get(LOG_BYTES_KEY) or 0)

    with client, two_budgets(url) as (a, b):
        big = created_id(create(a, words(20_000), interval_ms=2))
        wait_until(lambda: counted() > full_mark, "a's stream fills b's budget", 60.0)
        refused = create(b, "x")
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        small = created_id(create(a, words(5_000), interval_ms=20))  # a's budget is larger
        for stream_id in (big, small):
            assert httpx.post(f"{a.base_url}/v1/streams/{stream_id}/cancel").status_code == 202
            wait_for_state(a, stream_id, "cancelled")
        wait_until(lambda: counted() == 0, "the ended streams leave the count")
        created_id(create(b, "x"))
