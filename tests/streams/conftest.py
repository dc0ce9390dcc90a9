"""Fixtures for the stream tests: every event-log implementation, and a running hub
(the hub tests run with each log: in memory, in a real Redis, and in a real three-node
Redis Cluster)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as redis

from sluice.backends.words import WordsBackend
from sluice.streams import EventLog, HubSettings, LogLimits, MemoryEventLog, StreamHub
from sluice.streams.redis_client import RedisClient
from sluice.streams.redis_hub import RedisStreamHub
from sluice.streams.redis_log import RedisEventLog
from sluice.streams.shared import open_redis
from tests.redis_cluster import RedisClusterServers
from tests.redis_server import RedisServer

LogFactory = Callable[[LogLimits], EventLog]

# Each EventLog implementation is a param of ``make_log``; the contract tests run against
# all of them.
LOG_KINDS = ("memory", "redis", "cluster")
# Redis databases the tests hand out, one per log (a test may compare two logs that hold
# the same stream id); flushed before use.
_DATABASES = itertools.cycle(range(1, 16))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def redis_client(server: RedisServer) -> redis.Redis:
    """A client of a fresh (flushed) database of ``server``."""
    client = open_redis(f"redis://127.0.0.1:{server.port}/{next(_DATABASES)}")
    assert isinstance(client, redis.Redis)
    return client


def cluster_client(request: pytest.FixtureRequest) -> RedisClient:
    """A client of the session's Redis Cluster (started on first use), flushed."""
    cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
    cluster.flush()
    return open_redis(cluster.url)


@pytest.fixture(params=LOG_KINDS)
async def make_log(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[LogFactory]:
    if request.param == "memory":
        yield MemoryEventLog
        return
    # Outside ``running()`` a Redis log writes each append in its own pipeline: the
    # contract is the same. Each log gets a flushed database of its own.
    # A cluster has one database: a test's second log (which may hold the same stream
    # id as its first) is on the single Redis.
    async with contextlib.AsyncExitStack() as stack:
        clients: list[RedisClient] = []
        for _ in range(2):  # a contract test compares two logs at most
            plain = redis_client(redis_server)
            await plain.flushdb()
            stack.push_async_callback(plain.aclose)
            clients.append(plain)
        if request.param == "cluster":
            client = cluster_client(request)
            stack.push_async_callback(client.aclose)
            clients[-1] = client  # the first log a test makes

        def factory(limits: LogLimits) -> EventLog:
            return RedisEventLog(clients.pop(), limits)

        yield factory


@pytest.fixture(params=LOG_KINDS)
async def hub(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[StreamHub]:
    settings = HubSettings(default_grace_s=0.5, retention_s=30.0, max_streams=50)
    backends = {"words": WordsBackend()}
    if request.param == "memory":
        hub = StreamHub(MemoryEventLog(), backends, settings)
        async with hub.running():
            yield hub
        return
    client: RedisClient
    if request.param == "cluster":
        client = cluster_client(request)
    else:
        client = redis_client(redis_server)
        await client.flushdb()
    redis_hub = RedisStreamHub(RedisEventLog(client), backends, settings)
    async with redis_hub.running():
        yield redis_hub
    await client.aclose()
