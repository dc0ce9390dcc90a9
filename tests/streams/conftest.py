"""Fixtures for the stream tests: every event-log implementation, and a running hub
(the hub tests run with each log: in memory, and in a real Redis)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as redis

from sluice.backends.words import WordsBackend
from sluice.streams import EventLog, HubSettings, LogLimits, MemoryEventLog, StreamHub
from sluice.streams.redis_hub import RedisStreamHub
from sluice.streams.redis_log import RedisEventLog
from sluice.streams.shared import open_redis
from tests.redis_server import RedisServer

LogFactory = Callable[[LogLimits], EventLog]

# Each EventLog implementation is a param of ``make_log``; the contract tests run against
# all of them.
LOG_KINDS = ("memory", "redis")
# Redis databases the tests hand out, one per log (a test may compare two logs that hold
# the same stream id); flushed before use.
_DATABASES = itertools.cycle(range(1, 16))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def redis_client(server: RedisServer) -> redis.Redis:
    """A client of a fresh (flushed) database of ``server``."""
    return open_redis(f"redis://127.0.0.1:{server.port}/{next(_DATABASES)}")


@pytest.fixture(params=LOG_KINDS)
async def make_log(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[LogFactory]:
    if request.param == "memory":
        yield MemoryEventLog
        return
    # Outside ``running()`` a Redis log writes each append in its own pipeline: the
    # contract is the same. Each log gets a flushed database of its own.
    async with contextlib.AsyncExitStack() as stack:
        clients: list[redis.Redis] = []
        for _ in range(2):  # a contract test compares two logs at most
            client = redis_client(redis_server)
            await client.flushdb()
            stack.push_async_callback(client.aclose)
            clients.append(client)

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
    client = redis_client(redis_server)
    await client.flushdb()
    redis_hub = RedisStreamHub(RedisEventLog(client), backends, settings)
    async with redis_hub.running():
        yield redis_hub
    await client.aclose()
