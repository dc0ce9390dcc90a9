"""Which Redis client the streams use: one Redis, or a Redis Cluster.

``--redis redis://HOST:PORT/DB`` names one Redis (``unix://`` and ``rediss://`` too);
``--redis redis+cluster://HOST:PORT`` (or ``rediss+cluster://``) names any node of a Redis
Cluster, whose slot map the client then learns and follows. The scheme says which: the
client does not guess by asking the server, so a replica started against the wrong kind
fails at once instead of half working.

In a cluster, every command must touch keys of one slot. Sluice's keys are laid out for
that (:mod:`sluice.streams.redis_codec`): a stream's keys share the slot of its id, the
registry's keys share one slot of their own, and :func:`slot_groups` splits a round
trip's appends by slot (the cluster client then sends one pipeline per node, in
parallel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError
from redis.typing import EncodableT

__all__ = [
    "CLUSTER_SCHEMES",
    "CONNECT_TIMEOUT_S",
    "SOCKET_TIMEOUT_S",
    "Command",
    "RedisClient",
    "cluster_url",
    "is_cluster",
    "open_redis",
    "ready",
    "slot_groups",
]

RedisClient = redis.Redis | RedisCluster
# One command and its arguments, as a pipeline queues it.
Command = tuple[EncodableT, ...]

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
# A command Redis has not answered in this long is failed (its caller retries or ends
# its stream): long enough for a loaded Redis, short enough that nobody hangs.
SOCKET_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0

T = TypeVar("T")


def cluster_url(url: str) -> str | None:
    """The plain ``redis://`` URL of a ``redis+cluster://`` one; ``None`` for one Redis."""
    for scheme in CLUSTER_SCHEMES:
        if url.startswith(scheme):
            return scheme.replace("+cluster", "") + url[len(scheme) :]
    return None


def is_cluster(client: RedisClient) -> bool:
    return isinstance(client, RedisCluster)


def open_redis(url: str) -> RedisClient:
    """A client (and its connection pools) for ``url``; connections open on first use."""
    plain = cluster_url(url)
    if plain is not None:
        return RedisCluster.from_url(
            plain,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            max_connections=64,
        )
    return redis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        health_check_interval=0,
        max_connections=64,
    )


async def ready(client: RedisClient) -> None:
    """Make sure a cluster client knows the slot map (a pub/sub connection picks its
    node from it); nothing to do for one Redis. Raises :class:`RedisError`."""
    if isinstance(client, RedisCluster):
        try:
            await client.initialize()
        except RedisClusterException as exc:  # not a RedisError: translated here
            raise RedisError(str(exc)) from exc


def slot_groups(items: Iterable[T], key: Callable[[T], str], cluster: bool) -> list[list[T]]:
    """``items`` grouped by the cluster slot of ``key(item)``, in first-seen order; one
    group of them all on one Redis (where one script may touch any keys)."""
    if not cluster:
        whole = list(items)
        return [whole] if whole else []
    groups: dict[int, list[T]] = {}
    for item in items:
        groups.setdefault(key_slot(key(item).encode()), []).append(item)
    return list(groups.values())
