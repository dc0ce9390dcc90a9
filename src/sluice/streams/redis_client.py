"""Which Redis client the streams use: one Redis, or a Redis Cluster.

``--redis redis://HOST:PORT/DB`` names one Redis (``unix://`` and ``rediss://`` too);
``--redis redis+cluster://HOST:PORT`` (or ``rediss+cluster://``) names any node of a Redis
Cluster, whose slot map the client then learns and follows. The scheme says which: the
client does not guess by asking the server, so a replica started against the wrong kind
fails at once instead of half working.

One Redis is reached through connections that pack commands with hiredis
(:class:`HiredisPacking`): redis-py's asyncio connections pack in Python, joining the
command's bytes once per argument, which cost 1.7 ms for the ``APPEND`` call of a
1,000-stream step (4 arguments a token) and was the largest part of what the Redis log
added to a replica's CPU per token; hiredis, which redis-py already uses to parse replies,
packs the same bytes in C in a fifth of that. A cluster client picks its connection class
itself, so it keeps redis-py's packer.

In a cluster, every command must touch keys of one slot. Sluice's keys are laid out for
that (:mod:`sluice.streams.redis_codec`): a stream's keys share the slot of its id, the
registry's keys share one slot of their own, and :func:`slot_groups` splits a round
trip's appends by slot (the cluster client then sends one pipeline per node, in
parallel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar, cast

import hiredis
import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    BlockingConnectionPool,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError
from redis.typing import EncodableT

__all__ = [
    "CLUSTER_SCHEMES",
    "CONNECT_TIMEOUT_S",
    "SOCKET_TIMEOUT_S",
    "Command",
    "HiredisPacking",
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
# Connections a replica holds to one Redis; a command that finds them all busy waits for
# one (up to SOCKET_TIMEOUT_S) rather than failing: with redis-py's plain pool, more than
# 64 commands at once (a burst of stream creations on one replica) failed at once, and the
# creations were 503s. The cluster client cannot wait for a connection (past its limit a
# command fails), so its limit per node is set past any burst a replica admits.
_MAX_CONNECTIONS = 64
_MAX_CLUSTER_CONNECTIONS = 1024

T = TypeVar("T")


def cluster_url(url: str) -> str | None:
    """The plain ``redis://`` URL of a ``redis+cluster://`` one; ``None`` for one Redis."""
    for scheme in CLUSTER_SCHEMES:
        if url.startswith(scheme):
            return scheme.replace("+cluster", "") + url[len(scheme) :]
    return None


def is_cluster(client: RedisClient) -> bool:
    return isinstance(client, RedisCluster)


class HiredisPacking(AbstractConnection):
    """A connection whose commands are packed by hiredis (same bytes as redis-py's own
    :meth:`~redis.asyncio.connection.Connection.pack_command`, which a test pins)."""

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        first = args[0]
        # As redis-py: a command name with a space ("SCRIPT LOAD") is several arguments.
        if isinstance(first, str) and " " in first:
            args = (*first.encode().split(), *args[1:])
        elif isinstance(first, bytes) and b" " in first:
            args = (*first.split(), *args[1:])
        # The stub types the argument as a tuple of one item; it takes any number.
        return [hiredis.pack_command(args)]  # type: ignore[arg-type]


class _HiredisTCP(HiredisPacking, Connection):
    pass


class _HiredisSSL(HiredisPacking, SSLConnection):
    pass


class _HiredisUnix(HiredisPacking, UnixDomainSocketConnection):
    pass


_HIREDIS_CLASSES: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: _HiredisTCP,
    SSLConnection: _HiredisSSL,
    UnixDomainSocketConnection: _HiredisUnix,
}


def open_redis(url: str) -> RedisClient:
    """A client (and its connection pools) for ``url``; connections open on first use."""
    plain = cluster_url(url)
    if plain is not None:
        return RedisCluster.from_url(
            plain,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            max_connections=_MAX_CLUSTER_CONNECTIONS,
        )
    options: dict[str, object] = dict(parse_url(url))
    # The scheme picks the connection class (TCP, TLS, Unix socket): ours of the same kind.
    stock = cast(type[AbstractConnection], options.pop("connection_class", Connection))
    options["connection_class"] = _HIREDIS_CLASSES.get(stock, stock)
    pool = BlockingConnectionPool(
        timeout=SOCKET_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        health_check_interval=0,
        max_connections=_MAX_CONNECTIONS,
        **options,  # type: ignore[arg-type]
    )
    return redis.Redis.from_pool(pool)


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
