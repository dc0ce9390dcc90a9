"""The stream registry in Redis: admission against shared limits, producer leases, sweeps.

Key names in :mod:`sluice.streams.redis_codec`, scripts in
:mod:`sluice.streams.redis_scripts`. The registry's keys share one cluster slot
(``{registry}``); each stream's record (``sluice:{id}:meta``) lives in its stream's slot.

- **Admission** (:meth:`RedisRegistry.admit`): one ``ADMIT`` call counts a new stream
  against the live streams of the servers and of its tenant (``--max-streams``,
  ``--max-streams-per-tenant``) and the bytes the live streams' logs hold, of all and of
  its tenant (``--log-memory-budget``, ``--max-log-bytes-per-tenant``: refused, as one
  process refuses, when they would hold more than nine tenths of their bound), and
  registers it (its lease). Then its record goes beside its log.
- **Closing** (:meth:`RedisRegistry.closing`): a ``CLOSE`` call takes a stream out of
  those counts; only the one that removes its lease does, so an owner and a sweep never
  both subtract its bytes.
- **Producer lease**: the owner refreshes its streams' leases every heartbeat
  (:meth:`RedisRegistry.heartbeat`). Every replica sweeps expired leases: for each, one
  ``REAP`` call (the stream's slot) appends **one** retryable ``Error("unavailable")``
  to a log not already ended (the terminal entry carries the ``t`` field) and closes its
  record, then a ``CLOSE`` (the registry's slot) takes it out of the counts with the
  bytes its record says it held. Entry ids are the seqs, so a producer that comes back
  after losing its lease cannot append past that event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError

from sluice.errors import CapacityError, TenantLimitError
from sluice.events import Error
from sluice.streams.budget import LOG_MEMORY, TENANT_LOG_BYTES, full_mark
from sluice.streams.hub import HubSettings
from sluice.streams.redis_client import Command, RedisClient
from sluice.streams.redis_codec import (
    LEASES_KEY,
    LIVE_KEY,
    LOG_BYTES_KEY,
    TENANT_LOG_BYTES_KEY,
    encode_event,
    log_key,
    meta_key,
    replica_control_channel,
    replica_key,
    tenant_live_key,
)
from sluice.streams.redis_scripts import ADMIT, CLOSE, REAP
from sluice.streams.redis_writer import WRITE_TIMEOUT_S
from sluice.streams.sizing import LOG_BYTES

__all__ = ["DEFAULT_LEASE_S", "ClusterSettings", "RedisRegistry", "registry_unavailable"]

# The bound: a dead producer's streams end within 5 s.
DEFAULT_LEASE_S = 5.0

logger = logging.getLogger("sluice.streams.redis")

_LEASE_LOST = Error(
    "unavailable", "the server running this stream stopped; retry the request", True
)
# Streams one sweep ends at most (the rest wait for the next heartbeat).
_MAX_REAPED_PER_SWEEP = 256


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """How replicas share streams through Redis."""

    # A producer whose replica stops refreshing its lease for this long is presumed dead:
    # its streams get their retryable terminal event within it (plus one heartbeat).
    lease_s: float = DEFAULT_LEASE_S
    # Leases and this replica's presence are refreshed, and expired leases swept, this
    # often: a fifth of the lease, so a lease survives a few missed heartbeats.
    heartbeat_s: float = 1.0
    # A stream another replica runs stays followed this long after its last reader here
    # left (a client that reconnects here soon finds its mirror warm).
    linger_s: float = 10.0
    # The name of this replica in Redis; by default a fresh random one per process.
    replica_id: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.lease_s:
            raise ValueError("heartbeat_s must be positive and under lease_s")
        if self.linger_s < 0:
            raise ValueError("linger_s must not be negative")


def _count_keys(tenant: str) -> list[str]:
    """``ADMIT``'s and ``CLOSE``'s keys, all in the registry's slot."""
    return [LIVE_KEY, tenant_live_key(tenant), LEASES_KEY, LOG_BYTES_KEY, TENANT_LOG_BYTES_KEY]


def registry_unavailable(settings: HubSettings) -> CapacityError:
    """What a request Redis could not serve is refused with (``503`` + ``Retry-After``; an
    SSE read gets its ``retry:`` hint): a creation's admission, or the look-up and mirror
    of a stream another replica runs
    (:meth:`~sluice.streams.redis_hub.RedisStreamHub.attach`). Raise it ``from`` Redis's
    error."""
    return CapacityError(
        "the shared stream registry (Redis) is unavailable",
        retry_after_s=settings.retry_after_s,
        reason="registry_unavailable",
    )


class RedisRegistry:
    """One replica's view of the registry (see the module doc)."""

    def __init__(
        self, client: RedisClient, settings: HubSettings, cluster: ClusterSettings, replica_id: str
    ) -> None:
        self._client = client
        self._settings = settings
        self._cluster = cluster
        self.replica_id = replica_id
        self.num_reaped = 0

    async def admit(
        self, stream_id: str, model: str, resumable: bool, grace_s: float, tenant: str
    ) -> None:
        """Count and register a new stream; raises :class:`CapacityError` (503) or
        :class:`TenantLimitError` (429), both with ``Retry-After``."""
        settings = self._settings
        lease_ms = int((time.time() + self._cluster.lease_s) * 1000)
        ttl_s = int(settings.max_stream_s + settings.retention_s) + 1
        args: list[str | int | float] = [
            stream_id,
            settings.max_streams,
            settings.max_streams_per_tenant,
            lease_ms,
            tenant,
            full_mark(settings.log_budget_bytes),
            full_mark(settings.max_log_bytes_per_tenant),
            LOG_BYTES,
        ]
        keys = _count_keys(tenant)
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                answer = await self._client.eval(ADMIT, len(keys), *keys, *args)
        except (RedisError, OSError, TimeoutError) as exc:
            raise registry_unavailable(settings) from exc
        retry_after_s = settings.retry_after_s
        if answer == b"tenant":
            raise TenantLimitError(
                f"tenant {tenant!r} holds {settings.max_streams_per_tenant} live streams "
                "across the servers, its maximum",
                tenant=tenant,
                retry_after_s=retry_after_s,
            )
        if answer == b"server":
            raise CapacityError("too many streams on these servers", retry_after_s=retry_after_s)
        if answer == LOG_MEMORY.encode():
            raise CapacityError(
                "the event logs of the live streams fill these servers' shared memory budget",
                retry_after_s=retry_after_s,
                reason=LOG_MEMORY,
            )
        if answer == TENANT_LOG_BYTES.encode():
            raise TenantLimitError(
                f"the live streams of tenant {tenant!r} fill its share of the event logs "
                "across the servers",
                tenant=tenant,
                retry_after_s=retry_after_s,
            )
        fields: list[str | int | float] = [
            "model", model, "tenant", tenant, "resumable", int(resumable), "grace_s", grace_s,
            "created", time.time(), "owner", self.replica_id, "state", "queued",
            "bytes", LOG_BYTES,
        ]  # fmt: skip
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                pipe = self._client.pipeline(transaction=False)
                pipe.execute_command("HSET", meta_key(stream_id), *fields)
                pipe.expire(meta_key(stream_id), ttl_s)
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            with_closing = self.closing(stream_id, tenant, LOG_BYTES, 0)
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    pipe = self._client.pipeline(transaction=False)
                    for command in with_closing:
                        pipe.execute_command(*command)
                    await pipe.execute()
            except (RedisError, OSError, TimeoutError):
                logger.warning("stream %s: admitted, then Redis went away", stream_id)
            raise registry_unavailable(settings) from exc

    def closing(self, stream_id: str, tenant: str, num_bytes: int, ttl_s: int) -> list[Command]:
        """The commands that take a stream out of the live counts and the leases (and,
        with no retention, delete its record)."""
        keys = _count_keys(tenant)
        commands: list[Command] = [("EVAL", CLOSE, len(keys), *keys, stream_id, tenant, num_bytes)]
        if ttl_s <= 0:
            commands.append(("DEL", meta_key(stream_id)))
        return commands

    async def heartbeat(
        self, live: Sequence[str], readers: Sequence[str], announcements: Iterable[tuple[str, str]]
    ) -> list[str]:
        """Refresh this replica's presence and the leases of its ``live`` streams;
        announce its readers of other replicas' streams (``(owner, stream id)``); end
        the streams of producers that stopped refreshing theirs. Returns which of the
        ``readers`` replicas are gone."""
        now_ms = int(time.time() * 1000)
        lease_ms = int(self._cluster.lease_s * 1000)
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            pipe = self._client.pipeline(transaction=False)
            pipe.set(replica_key(self.replica_id), 1, px=lease_ms)
            if live:
                pipe.zadd(LEASES_KEY, dict.fromkeys(live, now_ms + lease_ms), xx=True)
            for replica in readers:
                pipe.exists(replica_key(replica))
            # Told again every heartbeat, so an owner that took this replica for gone (a
            # missed heartbeat) counts its readers again.
            for owner, stream_id in announcements:
                message = f"joined {stream_id} {self.replica_id}"
                # (execute_command: a cluster pipeline refuses its publish() method.)
                pipe.execute_command("PUBLISH", replica_control_channel(owner), message)
            pipe.zrangebyscore(LEASES_KEY, "-inf", now_ms, start=0, num=_MAX_REAPED_PER_SWEEP)
            answers = await pipe.execute()
            first = 1 + bool(live)
            alive = answers[first : first + len(readers)]
            gone = [replica for replica, exists in zip(readers, alive, strict=True) if not exists]
            for raw in answers[-1]:
                await self._reap(raw.decode())
        return gone

    async def _reap(self, stream_id: str) -> None:
        """End a stream whose lease expired (once), then take it out of the counts."""
        payload = encode_event(_LEASE_LOST)
        ttl_s = max(1, int(self._settings.retention_s))
        keys = [log_key(stream_id), meta_key(stream_id)]
        ended, tenant, num_bytes = await self._client.eval(
            REAP, len(keys), *keys, stream_id, payload, ttl_s
        )
        (close,) = self.closing(stream_id, tenant.decode(), int(num_bytes), 1)
        await self._client.execute_command(*close)
        if ended:
            self.num_reaped += 1
            logger.info("stream %s: its producer's lease expired; ended it", stream_id)
