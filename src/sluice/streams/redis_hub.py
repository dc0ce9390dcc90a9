"""The stream hub of one replica among several sharing a Redis: registry, cancel bus, leases.

A :class:`RedisStreamHub` is a :class:`~sluice.streams.hub.StreamHub` whose log is a
:class:`~sluice.streams.redis_log.RedisEventLog`. The replica that creates a stream runs its
producer, as one process would; what the others need is in Redis (key names in
:mod:`sluice.streams.redis_codec`):

- **Registry** (:mod:`sluice.streams.redis_registry`): creating a stream counts it
  against the live streams and the log bytes of the servers and of its tenant, so those
  limits and the memory budget hold across replicas, and writes its record (model,
  tenant, resumability, grace, render meta, owner replica) to ``sluice:{id}:meta``. Any
  replica then serves any read, resume, status or cancel: :meth:`attach` (called by the
  gateway before it looks a stream up) loads the record and follows the log.
- **Cancel bus**: each replica listens on its own control channel; a cancel, or a reader
  joining or leaving, on another replica is published to the owner's.
- **Reader presence**: the owner counts replicas that hold readers of its streams
  (``joined``/``left`` messages, ``joined`` repeated every heartbeat); a replica's presence
  is leased by its heartbeat key (``sluice:replica:<id>``), so a reader's replica that dies
  stops keeping a stream alive within a lease. The last-reader and grace rules count those
  replicas as readers.
- **Producer lease**: the owner refreshes its streams' leases every heartbeat, and every
  replica sweeps expired ones (:mod:`sluice.streams.redis_registry`): a dead producer's
  stream gets exactly one retryable ``Error("unavailable")``.
- **Redis unavailable**: a creation, and a read, resume, status or cancel of a stream
  another replica runs that Redis cannot look up or mirror (its record unread, or no
  subscription to follow it by), is refused at once
  (:func:`~sluice.streams.redis_registry.registry_unavailable`, a ``CapacityError``: 503
  with ``Retry-After``; an SSE read gets its ``retry:`` hint); a live stream's producer
  ends it with a retryable error for its local readers (the log raises), and the lease
  gives Redis's copy its terminal event once Redis is back; readers of followed streams
  are dropped so their clients resume, and the next read follows the stream again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Mapping

from redis.exceptions import RedisError

from sluice.backends.base import Backend, GenerationRequest
from sluice.events import Error, Finished, FinishReason, NeutralEvent, RenderMeta
from sluice.streams.hub import HubSettings, Stream, StreamHub, StreamObserver
from sluice.streams.ids import new_stream_id
from sluice.streams.reader import Reader
from sluice.streams.redis_codec import (
    decode_render,
    encode_render,
    log_key,
    meta_key,
    replica_control_channel,
    text_fields,
)
from sluice.streams.redis_log import WRITE_TIMEOUT_S, RedisEventLog, RedisUnavailableError
from sluice.streams.redis_registry import (
    DEFAULT_LEASE_S,
    ClusterSettings,
    RedisRegistry,
    registry_unavailable,
)
from sluice.streams.sizing import LOG_BYTES
from sluice.streams.state import StreamState

__all__ = ["DEFAULT_LEASE_S", "ClusterSettings", "RedisStreamHub"]

logger = logging.getLogger("sluice.streams.redis")


class RedisStreamHub(StreamHub):
    """A hub whose streams every replica on the same Redis can serve (see the module doc)."""

    def __init__(
        self,
        log: RedisEventLog,
        backends: Mapping[str, Backend],
        settings: HubSettings | None = None,
        observer: StreamObserver | None = None,
        cluster: ClusterSettings | None = None,
    ) -> None:
        super().__init__(log, backends, settings, observer)
        self.cluster = cluster or ClusterSettings()
        self.replica_id = self.cluster.replica_id or secrets.token_hex(8)
        self._redis_log = log
        self._client = log.client
        self._remote: dict[str, Stream] = {}  # streams other replicas run, served here
        self._owners: dict[str, str] = {}  # their owners
        self._presence: dict[str, set[str]] = {}  # own streams: replicas reading them
        self.registry = RedisRegistry(self._client, self.settings, self.cluster, self.replica_id)
        self.on_follow: Callable[[str, RenderMeta | None], None] | None = None
        """Called before a stream another replica runs is mirrored here, with its render
        meta (the frame cache then encodes it in its dialect)."""
        log.set_control(replica_control_channel(self.replica_id), self._on_control)
        log.on_lost = self._on_lost

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[StreamHub]:
        async with self._redis_log.running():
            async with super().running() as hub, asyncio.TaskGroup() as tasks:
                heartbeat = tasks.create_task(self._heartbeat_loop())
                try:
                    yield hub
                finally:
                    heartbeat.cancel()
            for stream in self._remote.values():
                if stream.timer is not None:
                    stream.timer.cancel()
            self._remote.clear()

    # ------------------------------------------------------------------ creation

    async def create(
        self,
        model: str,
        request: GenerationRequest,
        *,
        resumable: bool = True,
        grace_s: float | None = None,
        tenant: str = "anonymous",
        stream_id: str | None = None,
    ) -> Stream:
        stream_id = stream_id or new_stream_id()
        settings = self.settings
        grace = settings.default_grace_s if grace_s is None else grace_s
        registered = self.running_now and not self.draining and model in self.backends
        if registered:
            await self.registry.admit(stream_id, model, resumable, grace, tenant)
            self._redis_log.writer.count_bytes(stream_id, tenant)
        try:
            stream = await super().create(
                model,
                request,
                resumable=resumable,
                grace_s=grace_s,
                tenant=tenant,
                stream_id=stream_id,
            )
        except BaseException:
            if registered:
                self._redis_log.writer.uncount(stream_id)
                self._redis_log.send(*self.registry.closing(stream_id, tenant, LOG_BYTES, 0))
            raise
        return stream

    async def _append(self, stream: Stream, event: NeutralEvent) -> None:
        if not stream.num_events and stream.render is not None:
            # The gateway sets a dialect's render meta after creation, before the producer
            # runs: it goes to the registry just before the first event.
            render = encode_render(stream.render)
            self._redis_log.send(("HSET", meta_key(stream.id), "render", render))
        await super()._append(stream, event)

    async def _finish(self, stream: Stream, final: list[NeutralEvent], target: StreamState) -> None:
        await super()._finish(stream, final, target)
        self._presence.pop(stream.id, None)
        if not self._redis_log.writes_here(stream.id) or self._redis_log.is_local_only(stream.id):
            return  # Redis lost the stream: its lease gives it a terminal event
        ttl_s = max(1, int(self.settings.retention_s))
        counted = self._redis_log.writer.uncount(stream.id)
        num_bytes = LOG_BYTES if counted is None else counted[1]
        self._redis_log.send(
            ("HSET", meta_key(stream.id), "state", stream.state.value,
             "finish_reason", stream.finish_reason or "", "events", stream.num_events,
             "tokens", stream.num_tokens),
            ("EXPIRE", meta_key(stream.id), ttl_s),
            ("EXPIRE", log_key(stream.id), ttl_s),
            *self.registry.closing(stream.id, stream.tenant, num_bytes, ttl_s),
        )  # fmt: skip

    # ------------------------------------------------------------------ other replicas' streams

    async def attach(self, stream_id: str) -> None:
        if stream_id in self._streams:
            return
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                answer = await self._client.hgetall(meta_key(stream_id))
        except (RedisError, OSError, TimeoutError) as exc:
            raise registry_unavailable(self.settings) from exc
        fields = {k: v for k, v in answer.items() if isinstance(k, bytes) and isinstance(v, bytes)}
        if not fields:
            return
        record = text_fields(fields)
        owner = record.get("owner", "")
        if owner == self.replica_id:
            return  # this replica's own stream, forgotten here: gone
        render = decode_render(fields.get(b"render", b""))
        # Followed again if Redis dropped its mirror while a reader here held it (the
        # stream lingers in ``_remote`` until then); a no-op for a stream followed now.
        if self.on_follow is not None and not self._redis_log.follows(stream_id):
            self.on_follow(stream_id, render)
        try:
            await self._redis_log.follow(stream_id)
        except RedisUnavailableError as exc:  # the subscription is down: no mirror
            raise registry_unavailable(self.settings) from exc
        stream = self._remote.get(stream_id)  # attached meanwhile by another request?
        if stream is None:
            stream = Stream(
                id=stream_id,
                model=record.get("model", ""),
                resumable=record.get("resumable") == "1",
                grace_s=float(record.get("grace_s", "0")),
                created=float(record.get("created", "0")),
                tenant=record.get("tenant", "anonymous"),
                render=render,
            )
            self._remote[stream_id] = stream
            self._owners[stream_id] = owner
            self._arm_release(stream)
        self._refresh(stream, record)

    def _refresh(self, stream: Stream, record: Mapping[str, str]) -> None:
        """Bring a followed stream's state and counts up to what its log and record say."""
        log = self._redis_log.mirror
        if stream.id not in log:
            return
        last = log.last_seq(stream.id)
        stream.num_events = last
        if record.get("tokens"):
            stream.num_tokens = int(record["tokens"])
        state = StreamState(record.get("state", "queued"))
        if last >= log.first_seq(stream.id) and last > 0:
            event = log.read(stream.id, last - 1, 1).events[0]
            if isinstance(event, Finished):
                stream.finish_reason = event.reason.value
                cancelled = event.reason is FinishReason.CANCELLED
                state = StreamState.CANCELLED if cancelled else StreamState.FINISHED
            elif isinstance(event, Error):
                stream.finish_reason, state = "error", StreamState.FAILED
            elif state is StreamState.QUEUED:
                state = StreamState.RUNNING
        stream.state = state

    def get(self, stream_id: str) -> Stream:
        stream = self._remote.get(stream_id)
        if stream is not None:
            self._refresh(stream, {"state": stream.state.value})
            return stream
        return super().get(stream_id)

    def cancel(self, stream_id: str) -> Stream:
        stream = self._remote.get(stream_id)
        if stream is None:
            return super().cancel(stream_id)
        if not stream.is_terminal and not stream.cancel_requested:
            stream.cancel_requested = True
            self._publish(stream_id, f"cancel {stream_id}")
        return stream

    def open_reader(self, stream_id: str, after_seq: int) -> Reader:
        reader = super().open_reader(stream_id, after_seq)
        stream = self._remote.get(stream_id)
        if stream is not None and len(stream.readers) == 1:
            self._publish(stream_id, f"joined {stream_id} {self.replica_id}")
        return reader

    def _reader_left(self, reader: Reader) -> None:
        stream_id = reader.stream_id
        remote = self._remote.get(stream_id)
        if remote is not None:
            remote.readers.remove(reader)
            if not remote.readers:
                self._publish(stream_id, f"left {stream_id} {self.replica_id}")
                self._arm_release(remote)
            return
        stream = self._streams.get(stream_id)
        if stream is not None and self._presence.get(stream_id):
            stream.readers.remove(reader)  # readers elsewhere keep it alive
            return
        super()._reader_left(reader)

    def _grace_over(self, stream_id: str) -> None:
        if self._presence.get(stream_id):
            stream = self._streams.get(stream_id)
            if stream is not None:
                stream.timer = None
            return
        super()._grace_over(stream_id)

    def _publish(self, stream_id: str, message: str) -> None:
        owner = self._owners.get(stream_id)
        if owner is not None:
            self._redis_log.send(("PUBLISH", replica_control_channel(owner), message))

    def _arm_release(self, stream: Stream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
        loop = asyncio.get_running_loop()
        stream.timer = loop.call_later(self.cluster.linger_s, self._release, stream.id)

    def _release(self, stream_id: str) -> None:
        """Stop following a stream nobody here reads."""
        stream = self._remote.get(stream_id)
        if stream is None:
            return
        stream.timer = None
        if stream.readers:
            return
        del self._remote[stream_id]
        self._owners.pop(stream_id, None)
        self._redis_log.unfollow(stream_id)

    def _on_lost(self, stream_id: str) -> None:
        """Redis went away under a followed stream: its clients resume (once it is back)."""
        stream = self._remote.get(stream_id)
        if stream is None:
            return
        for reader in list(stream.readers):
            reader.interrupt()
        if not stream.readers:
            self._release(stream_id)

    # ------------------------------------------------------------------ the owner's side

    def _on_control(self, data: bytes) -> None:
        """A message on this replica's control channel: ``cancel <id>``, ``joined <id>
        <replica>`` or ``left <id> <replica>``."""
        verb, _, rest = data.decode(errors="replace").partition(" ")
        stream_id, _, replica = rest.partition(" ")
        stream = self._streams.get(stream_id)
        if stream is None or stream.is_terminal:
            return
        if verb == "cancel":
            self.cancel(stream_id)
        elif verb == "joined":
            self._presence.setdefault(stream_id, set()).add(replica)
            if stream.timer is not None:
                stream.timer.cancel()  # a reader is here (elsewhere): no grace window
                stream.timer = None
        elif verb == "left":
            readers = self._presence.get(stream_id)
            if readers is not None:
                readers.discard(replica)
            self._no_remote_readers(stream)

    def _no_remote_readers(self, stream: Stream) -> None:
        """The last replica reading ``stream`` elsewhere left: the local rules decide."""
        if self._presence.get(stream.id) or stream.readers or stream.is_terminal:
            return
        self._presence.pop(stream.id, None)
        if stream.resumable and stream.grace_s > 0:
            self._arm_grace(stream)
        else:
            stream.cancel_cause = "client_gone"
            self.cancel(stream.id)

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self._heartbeat()
            except (RedisError, OSError, TimeoutError) as exc:
                logger.warning("Redis heartbeat failed: %s", exc)
            await asyncio.sleep(self.cluster.heartbeat_s)

    async def _heartbeat(self) -> None:
        """Refresh this replica's presence and its streams' leases; forget replicas that
        stopped refreshing theirs; end the streams of producers that did."""
        writes_here = self._redis_log.writes_here
        local_only = self._redis_log.is_local_only
        live = [
            stream.id
            for stream in self.live_streams()
            if writes_here(stream.id) and not local_only(stream.id)
        ]
        readers = sorted({replica for group in self._presence.values() for replica in group})
        announcements = [
            (self._owners[stream_id], stream_id)
            for stream_id, stream in self._remote.items()
            if stream.readers and stream_id in self._owners and not stream.is_terminal
        ]
        for replica in await self.registry.heartbeat(live, readers, announcements):
            self._replica_gone(replica)

    @property
    def num_reaped(self) -> int:
        """Streams this replica's sweeps ended (their producer's lease expired)."""
        return self.registry.num_reaped

    def _replica_gone(self, replica: str) -> None:
        for stream_id, group in list(self._presence.items()):
            if replica in group:
                group.discard(replica)
                stream = self._streams.get(stream_id)
                if stream is not None:
                    self._no_remote_readers(stream)
