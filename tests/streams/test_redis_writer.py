"""The Redis log's writer on a real three-node Redis Cluster: one round trip carries the
appends of streams in several slots (one ``APPEND`` call per slot), and each append gets
its own stream's answer."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from redis.crc import key_slot

from sluice.errors import BackendError
from sluice.events import TextDelta
from sluice.streams.redis_codec import log_key
from sluice.streams.redis_log import RedisEventLog
from tests.redis_cluster import RedisClusterServers
from tests.streams.conftest import cluster_client

pytestmark = pytest.mark.anyio


def _slot(stream_id: str) -> int:
    return key_slot(log_key(stream_id).encode())


def _sharing_a_slot_with(stream_id: str) -> str:
    """Another stream id whose keys hash to the slot of ``stream_id``'s."""
    slot = _slot(stream_id)
    for i in itertools.count():
        other = f"str_slotmate{i:014d}"
        if _slot(other) == slot:
            return other
    raise AssertionError("unreachable")  # pragma: no cover


async def test_one_round_trip_answers_each_append_of_streams_in_interleaved_slots(
    request: pytest.FixtureRequest, redis_cluster: RedisClusterServers
) -> None:
    """Appends to A, B, then C (C in A's slot, B in another) go in one round trip, as
    two ``APPEND`` calls ([A, C] and [B]); B's fails (its log already ends further on),
    and that failure is B's alone."""
    first, other = "str_0123456789abcdefABCDEF", "str_FEDCBA9876543210fedcba"
    assert _slot(first) != _slot(other)
    mate = _sharing_a_slot_with(first)
    client = cluster_client(request)
    log = RedisEventLog(client)
    try:
        await client.xadd(log_key(other), {"e": b'["t","x"]'}, id="0-5")
        async with log.running():
            for stream_id in (first, other, mate):
                await log.create(stream_id)
            before = log.num_round_trips
            results = await asyncio.gather(
                log.append(first, [TextDelta("a")]),
                log.append(other, [TextDelta("b")]),
                log.append(mate, [TextDelta("c")]),
                return_exceptions=True,
            )
            assert log.num_round_trips == before + 1
            assert results[0] == 1
            assert results[2] == 1
            assert isinstance(results[1], BackendError)
            assert log.is_local_only(other)
            assert not log.is_local_only(first)
            assert not log.is_local_only(mate)
            for stream_id, text in ((first, "a"), (mate, "c")):
                assert list(log.read(stream_id, 0, 10).events) == [TextDelta(text)]
                entries = await client.xrange(log_key(stream_id))
                assert [eid for eid, _ in entries] == [b"0-1"]
    finally:
        await client.aclose()
