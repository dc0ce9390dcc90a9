"""The stream registry in Redis (one Redis and a three-node cluster): admission counts
live streams and their log bytes, and a lease sweep ends a dead producer's stream once
and takes it out of every count once."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sluice.errors import CapacityError, TenantLimitError
from sluice.events import TextDelta
from sluice.streams import HubSettings
from sluice.streams.redis_client import RedisClient
from sluice.streams.redis_codec import (
    LEASES_KEY,
    LIVE_KEY,
    LOG_BYTES_KEY,
    TENANT_LOG_BYTES_KEY,
    decode_event,
    encode_event,
    log_key,
    meta_key,
    tenant_live_key,
)
from sluice.streams.redis_registry import ClusterSettings, RedisRegistry
from sluice.streams.sizing import LOG_BYTES
from tests.redis_server import RedisServer
from tests.streams.conftest import cluster_client, redis_client

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["redis", "cluster"])
async def client(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[RedisClient]:
    if request.param == "cluster":
        shared = cluster_client(request)
    else:
        plain = redis_client(redis_server)
        await plain.flushdb()
        shared = plain
    yield shared
    await shared.aclose()


def registry_of(client: RedisClient, **settings: int) -> RedisRegistry:
    return RedisRegistry(client, HubSettings(**settings), ClusterSettings(), "replica-1")


async def counted(client: RedisClient) -> int:
    return int(await client.get(LOG_BYTES_KEY) or 0)


async def test_admission_refuses_once_live_logs_fill_nine_tenths_of_the_shared_budget(
    client: RedisClient,
) -> None:
    registry = registry_of(client, log_budget_bytes=8 * LOG_BYTES)
    for i in range(7):  # 7 empty logs: 7/8 of the budget, under its nine tenths
        await registry.admit(f"str_{i}", "words", True, 1.0, "acme")
    assert await counted(client) == 7 * LOG_BYTES
    with pytest.raises(CapacityError) as refused:
        await registry.admit("str_7", "words", True, 1.0, "acme")
    assert refused.value.reason == "log_memory"
    assert refused.value.retry_after_s > 0
    await client.execute_command(*registry.closing("str_0", "acme", LOG_BYTES, 1)[0])
    await registry.admit("str_7", "words", True, 1.0, "acme")


async def test_admission_refuses_a_tenant_whose_live_logs_fill_its_share(
    client: RedisClient,
) -> None:
    registry = registry_of(
        client, log_budget_bytes=100 * LOG_BYTES, max_log_bytes_per_tenant=3 * LOG_BYTES
    )
    for i in range(2):
        await registry.admit(f"str_{i}", "words", True, 1.0, "acme")
    with pytest.raises(TenantLimitError):
        await registry.admit("str_2", "words", True, 1.0, "acme")
    await registry.admit("str_3", "words", True, 1.0, "other")  # another tenant's room


async def test_a_sweep_ends_an_expired_lease_once_and_uncounts_it_once(
    client: RedisClient,
) -> None:
    registry = registry_of(client)
    stream_id = "str_0123456789abcdefABCDEF"
    await registry.admit(stream_id, "words", True, 1.0, "acme")
    grown = 1_000  # what a writer would have counted for one append
    await client.xadd(log_key(stream_id), {"e": encode_event(TextDelta("a"))}, id="0-1")
    await client.hincrby(meta_key(stream_id), "bytes", grown)
    await client.incrby(LOG_BYTES_KEY, grown)
    await client.hincrby(TENANT_LOG_BYTES_KEY, "acme", grown)
    await client.zadd(LEASES_KEY, {stream_id: 0})  # its producer stopped renewing it
    for _ in range(2):  # a second sweep finds nothing left to do
        assert await registry.heartbeat([], [], []) == []
    assert registry.num_reaped == 1
    entries = await client.xrange(log_key(stream_id))
    assert [eid for eid, _ in entries] == [b"0-1", b"0-2"]
    last = entries[-1][1]
    assert b"t" in last
    error = decode_event(last[b"e"])
    assert getattr(error, "retryable", False) is True
    assert await counted(client) == 0
    assert await client.hget(TENANT_LOG_BYTES_KEY, "acme") is None
    assert await client.scard(LIVE_KEY) == 0
    assert await client.scard(tenant_live_key("acme")) == 0
    assert await client.zcard(LEASES_KEY) == 0
    assert await client.hget(meta_key(stream_id), "state") == b"failed"
    # Its owner, back after all, closes it too: nothing is taken out twice.
    (close,) = registry.closing(stream_id, "acme", LOG_BYTES + grown, 1)
    assert await client.execute_command(*close) == 0
