"""Which event log and hub a process runs: its own memory, or a Redis shared by replicas.

:class:`SharedStreams` names the Redis (``sluice serve --redis redis://HOST:PORT/DB``)
and how replicas share streams through it; :func:`open_redis` makes the client every part
uses (short socket timeouts, so a Redis that went away fails a request in seconds rather
than hanging it).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import redis as sync_redis
import redis.asyncio as redis
from redis.exceptions import RedisError

from sluice.errors import ConfigError
from sluice.streams.redis_hub import ClusterSettings

__all__ = ["REDIS_URL_ENV", "SharedStreams", "open_redis", "shared_token_secret"]

REDIS_URL_ENV = "SLUICE_REDIS_URL"
TOKEN_SECRET_KEY = "sluice:token-secret"
# A command Redis has not answered in this long is failed (its caller retries or ends
# its stream): long enough for a loaded Redis, short enough that nobody hangs.
SOCKET_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class SharedStreams:
    """Streams shared by every replica that names the same Redis."""

    url: str
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"--redis: a redis://HOST:PORT/DB URL, got {self.url[:80]!r}")


def shared_token_secret(url: str) -> bytes:
    """The resume-token secret every replica on the Redis at ``url`` shares: the first
    replica to start makes it (``SET NX``), the others read it. Raises
    :class:`ConfigError` when Redis cannot be reached."""
    client = sync_redis.Redis.from_url(
        url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S
    )
    try:
        client.set(TOKEN_SECRET_KEY, secrets.token_hex(32), nx=True)
        secret = client.get(TOKEN_SECRET_KEY)
    except RedisError as exc:
        raise ConfigError(f"--redis {url}: {exc}") from exc
    finally:
        client.close()
    if not isinstance(secret, bytes):  # pragma: no cover - set just above
        raise ConfigError(f"--redis {url}: no token secret")
    return secret


def open_redis(url: str) -> redis.Redis:
    """A client (and its connection pool) for ``url``; connections open on first use."""
    return redis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        health_check_interval=0,
        max_connections=64,
    )
