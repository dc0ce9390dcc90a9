"""The Redis log's writer on a real Redis: on a three-node Redis Cluster, one round trip
carries the appends of streams in several slots (one ``APPEND`` call per slot), and each
append gets its own stream's answer; on one Redis, a producer's appends that nobody waits
for, and what happens when Redis refuses them."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from redis.crc import key_slot

from sluice.backends.base import GenerationRequest
from sluice.backends.words import WordsBackend
from sluice.errors import BackendError
from sluice.events import Error, Finished, TextDelta
from sluice.streams import HubSettings
from sluice.streams.redis_codec import log_key
from sluice.streams.redis_hub import RedisStreamHub
from sluice.streams.redis_log import RedisEventLog
from tests.redis_cluster import RedisClusterServers
from tests.redis_server import RedisServer
from tests.streams.conftest import cluster_client, redis_client
from tests.streams.reading import read_until, read_until_done

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


# ---------------------------------------------------------------- appends nobody waits for

SID = "str_0123456789abcdefABCDEF"


async def test_appends_not_waited_for_reach_readers_only_once_redis_has_them(
    redis_server: RedisServer,
) -> None:
    """A producer's ``wait=False`` appends return before their round trip; the mirror
    (what readers read) gets them, in order, only once Redis has them."""
    client = redis_client(redis_server)
    await client.flushdb()
    log = RedisEventLog(client)
    try:
        async with log.running():
            await log.create(SID)
            seqs = [await log.append(SID, [TextDelta(t)], wait=False) for t in "abc"]
            assert seqs == [1, 2, 3]
            assert list(log.read(SID, 0, 10).events) == []  # queued, not yet in Redis
            await log.sync(SID)
            assert list(log.read(SID, 0, 10).events) == [TextDelta(t) for t in "abc"]
            entries = await client.xrange(log_key(SID))
            assert [eid for eid, _ in entries] == [b"0-1", b"0-2", b"0-3"]
    finally:
        await client.aclose()


async def test_a_failed_append_nobody_waited_for_is_raised_once_and_nothing_follows_it(
    redis_server: RedisServer,
) -> None:
    """Redis refuses a stream's queued appends (its log already ends further on): the
    stream's next ``sync`` (or append) raises that, once; nothing of the stream after the
    missing events reaches Redis; the stream goes on in this replica only."""
    client = redis_client(redis_server)
    await client.flushdb()
    log = RedisEventLog(client)
    try:
        await client.xadd(log_key(SID), {"e": b'["t","x"]'}, id="0-5")
        async with log.running():
            await log.create(SID)
            for text in "abc":
                await log.append(SID, [TextDelta(text)], wait=False)
            with pytest.raises(BackendError, match="Redis refused the write"):
                await log.sync(SID)
            await log.sync(SID)  # told once
            assert log.is_local_only(SID)
            await log.append(SID, [TextDelta("d")])  # this replica's readers only
            assert list(log.read(SID, 0, 10).events) == [TextDelta("d")]
            entries = await client.xrange(log_key(SID))
            assert [eid for eid, _ in entries] == [b"0-5"]  # only what was there
    finally:
        await client.aclose()


async def test_a_stream_whose_tokens_redis_refuses_ends_with_one_retryable_error(
    redis_server: RedisServer,
) -> None:
    """The hub's producer does not wait for its tokens to be stored; when Redis stops
    taking them, the stream still ends with exactly one terminal event, a retryable
    error, which a reader on this replica gets."""
    client = redis_client(redis_server)
    await client.flushdb()
    settings = HubSettings(default_grace_s=30, retention_s=30)
    hub = RedisStreamHub(RedisEventLog(client), {"words": WordsBackend()}, settings)
    try:
        async with hub.running():
            request = GenerationRequest("w " * 1000, interval_s=0.01)
            stream = await hub.create("words", request)
            reader = hub.open_reader(stream.id, 0)
            first = await read_until(reader, lambda events: len(events) >= 4)
            # Another writer took the log further on: Redis refuses this one's next append.
            await client.xadd(log_key(stream.id), {"e": b'["t","x"]'}, id="0-999999")
            rest = await read_until_done(reader)
            events = first + rest
            terminals = [e for e in events if isinstance(e, Error | Finished)]
            assert len(terminals) == 1
            assert isinstance(events[-1], Error)
            assert events[-1].retryable
            assert events[-1].type == "backend_error"
    finally:
        await client.aclose()


async def test_a_log_stopped_right_after_its_first_writes_stops(
    redis_server: RedisServer,
) -> None:
    """Its subscriber may still be connecting or subscribing when the log stops, where
    redis-py can lose a cancel: the log stops all the same (each time, bounded)."""
    for attempt in range(10):
        client = redis_client(redis_server)
        await client.flushdb()
        log = RedisEventLog(client)
        try:
            async with asyncio.timeout(5):
                async with log.running():
                    await log.create(SID)
                    await log.append(SID, [TextDelta(str(attempt))], wait=False)
                    await log.sync(SID)
        finally:
            await client.aclose()
