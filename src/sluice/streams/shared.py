"""Which event log and hub a process runs: its own memory, or a Redis shared by replicas.

:class:`SharedStreams` names the Redis (``sluice serve --redis redis://HOST:PORT/DB``,
or ``redis+cluster://HOST:PORT`` for a Redis Cluster) and how replicas share streams
through it; :func:`~sluice.streams.redis_client.open_redis` makes the client every part
uses (short socket timeouts, so a Redis that went away fails a request in seconds rather
than hanging it).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import redis as sync_redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from sluice.errors import ConfigError
from sluice.streams.redis_client import (
    CLUSTER_SCHEMES,
    CONNECT_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    cluster_url,
    open_redis,
)
from sluice.streams.redis_registry import ClusterSettings

__all__ = ["REDIS_URL_ENV", "SharedStreams", "open_redis", "shared_token_secret"]

REDIS_URL_ENV = "SLUICE_REDIS_URL"
TOKEN_SECRET_KEY = "sluice:token-secret"


@dataclass(frozen=True, slots=True)
class SharedStreams:
    """Streams shared by every replica that names the same Redis."""

    url: str
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)):
            raise ConfigError(
                "--redis: a redis://HOST:PORT/DB or redis+cluster://HOST:PORT URL, "
                f"got {self.url[:80]!r}"
            )


def shared_token_secret(url: str) -> bytes:
    """The resume-token secret every replica on the Redis at ``url`` shares: the first
    replica to start makes it (``SET NX``), the others read it. Raises
    :class:`ConfigError` when Redis cannot be reached."""
    timeouts = {"socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": CONNECT_TIMEOUT_S}
    plain = cluster_url(url)
    client: sync_redis.Redis | RedisCluster
    try:
        if plain is not None:
            client = RedisCluster.from_url(plain, **timeouts)
        else:
            client = sync_redis.Redis.from_url(url, **timeouts)
    except (RedisError, RedisClusterException) as exc:  # a cluster client connects at once
        raise ConfigError(f"--redis {url}: {exc}") from exc
    try:
        client.set(TOKEN_SECRET_KEY, secrets.token_hex(32), nx=True)
        secret = client.get(TOKEN_SECRET_KEY)
    except (RedisError, RedisClusterException) as exc:
        raise ConfigError(f"--redis {url}: {exc}") from exc
    finally:
        client.close()
    if not isinstance(secret, bytes):  # pragma: no cover - set just above
        raise ConfigError(f"--redis {url}: no token secret")
    return secret
