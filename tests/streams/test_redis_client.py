"""Which Redis client a URL names, how it packs commands, and how a round trip's keys group
by cluster slot."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.crc import key_slot

from sluice.errors import ConfigError
from sluice.streams.redis_client import HiredisPacking, cluster_url, open_redis, slot_groups
from sluice.streams.redis_codec import LEASES_KEY, LIVE_KEY, log_key, meta_key, tenant_live_key
from sluice.streams.shared import SharedStreams
from tests.streams.conftest import cluster_client, redis_client


def test_a_cluster_url_names_the_plain_url_of_one_of_its_nodes() -> None:
    assert cluster_url("redis+cluster://10.0.0.1:7000") == "redis://10.0.0.1:7000"
    assert cluster_url("rediss+cluster://u:p@h:7000") == "rediss://u:p@h:7000"
    assert cluster_url("redis://10.0.0.1:6379/0") is None


def test_shared_streams_take_one_redis_or_a_cluster_and_nothing_else() -> None:
    assert SharedStreams("redis+cluster://127.0.0.1:7000").url.startswith("redis+cluster")
    assert SharedStreams("redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigError, match="redis\\+cluster://"):
        SharedStreams("http://127.0.0.1:6379")


def test_on_one_redis_a_round_trips_keys_are_one_group() -> None:
    ids = ["a", "b", "c"]
    assert slot_groups(ids, log_key, cluster=False) == [ids]
    assert slot_groups([], log_key, cluster=False) == []


def test_on_a_cluster_keys_group_by_slot_in_first_seen_order() -> None:
    ids = [f"str_{i}" for i in range(40)]
    groups = slot_groups(ids, log_key, cluster=True)
    assert sorted(i for group in groups for i in group) == sorted(ids)
    for group in groups:
        assert len({key_slot(log_key(i).encode()) for i in group}) == 1
    firsts = [group[0] for group in groups]
    assert firsts == sorted(firsts, key=ids.index)


def test_a_streams_keys_share_its_slot_and_the_registrys_keys_share_theirs() -> None:
    assert key_slot(log_key("s1").encode()) == key_slot(meta_key("s1").encode())
    registry = {key_slot(k.encode()) for k in (LEASES_KEY, LIVE_KEY, tenant_live_key("acme"))}
    assert len(registry) == 1


@pytest.mark.parametrize(
    "command",
    [
        ("EVALSHA", "a" * 40, 4, b"{str_x}:log", b"{str_x}:meta", 1000, b"1 2 0 35", b"\x00\xff"),
        ("SCRIPT LOAD", "return 1"),
        (b"CLIENT SETNAME", b"sluice"),
        ("HINCRBY", "sluice:{registry}:tenant-bytes", "t\u00e9nant", -12),
        ("SET", "k", 2.5),
    ],
)
def test_hiredis_packing_writes_the_bytes_redis_py_writes(command: tuple[object, ...]) -> None:
    """Our packer is a drop-in for redis-py's: same RESP bytes for names with spaces,
    bytes, str (UTF-8), ints and floats."""
    connection = open_redis("redis://127.0.0.1:1/0").connection_pool.make_connection()
    ours = b"".join(connection.pack_command(*command))  # type: ignore[arg-type]
    theirs = b"".join(Connection().pack_command(*command))  # type: ignore[arg-type]
    assert ours == theirs


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("redis://127.0.0.1:6379/0", Connection),
        ("rediss://127.0.0.1:6380/0", SSLConnection),
        ("unix:///tmp/redis.sock?db=1", UnixDomainSocketConnection),
    ],
)
def test_one_redis_connects_as_its_scheme_says_and_packs_with_hiredis(
    url: str, kind: type[Connection]
) -> None:
    client = open_redis(url)
    assert isinstance(client, redis.Redis)
    connection_class = client.connection_pool.connection_class
    assert issubclass(connection_class, kind)
    assert issubclass(connection_class, HiredisPacking)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_a_burst_of_commands_past_the_pools_size_waits_for_connections(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """A replica that gets more concurrent Redis commands than its pool holds (64
    connections; a burst of stream creations does it) queues them: none fails."""
    client = (
        redis_client(request.getfixturevalue("redis_server"))
        if kind == "redis"
        else cluster_client(request)
    )
    try:
        script = "return redis.call('INCR', KEYS[1])"
        assert await client.eval(script, 1, "k") == 1  # the cluster client's topology read
        answers = await asyncio.gather(*(client.eval(script, 1, "k") for _ in range(299)))
        assert sorted(answers) == list(range(2, 301))
    finally:
        await client.aclose()
