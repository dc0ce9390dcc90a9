"""The composition root: what one Sluice process runs, built once and entered once.

A :class:`Runtime` owns the event log (and the frame cache beside it), the backends, the
metrics, the stream hub and the shutdown event. The ASGI app enters it from its lifespan
(:class:`~sluice.gateway.app.SluiceApp`), and so can any other front (a gRPC server) or a
test; each front reads the same hub, so a stream started through one is read through any.

Order on entry: the resources (an embedded engine's driver thread) start, then the hub.
On exit the hub stops first (its last cancellations still reach the engine), then the
backends close and the resources stop. :meth:`drain` sets :attr:`shutdown` before the hub
refuses new streams, for fronts that stop accepting work when it is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from sluice.backends.base import Backend
from sluice.events import RenderMeta
from sluice.observability.metrics import Metrics
from sluice.streams.hub import HubSettings, StreamHub
from sluice.streams.log import EventLog, LogLimits
from sluice.streams.memory import MemoryEventLog
from sluice.streams.redis_hub import RedisStreamHub
from sluice.streams.redis_log import RedisEventLog
from sluice.streams.shared import SharedStreams, open_redis
from sluice.transports.frames import FrameCache, encoder_for

__all__ = ["Resource", "Runtime"]

Resource = contextlib.AbstractAsyncContextManager[object]


@runtime_checkable
class _AbortObserved(Protocol):
    """A backend that reports how long its aborts take to free resources (the engine)."""

    def set_abort_observer(self, observer: Callable[[float], None] | None) -> None: ...


class Runtime:
    """The log, frame cache, backends, metrics, hub and shutdown event of one process."""

    def __init__(
        self,
        backends: Mapping[str, Backend],
        *,
        log_limits: LogLimits,
        hub_settings: HubSettings,
        resources: Sequence[Resource] = (),
        shared: SharedStreams | None = None,
    ) -> None:
        self.backends = dict(backends)
        self._resources = tuple(resources)
        # Each stream's frames, encoded once per event beside its log (and counted in it).
        self.frames = FrameCache()
        self.log: EventLog
        versions = {name: str(getattr(b, "version", "")) for name, b in self.backends.items()}
        self.metrics = Metrics(versions)
        for name, backend in self.backends.items():
            if isinstance(backend, _AbortObserved):
                backend.set_abort_observer(functools.partial(self.metrics.abort_freed, name))
        self.hub: StreamHub
        if shared is None:
            self.log = MemoryEventLog(log_limits, observer=self.frames)
            self.hub = StreamHub(self.log, self.backends, hub_settings, observer=self.metrics)
        else:  # the streams live in Redis, shared by every replica (sluice.streams.redis_hub)
            log = RedisEventLog(open_redis(shared.url), log_limits, observer=self.frames)
            hub = RedisStreamHub(log, self.backends, hub_settings, self.metrics, shared.cluster)
            hub.on_follow = self._render_followed
            self.log, self.hub = log, hub
        self.metrics.log_bytes.set_function(lambda: self.hub.memory.num_bytes)
        self.shutdown = asyncio.Event()
        """Set when the process begins to stop (:meth:`drain`)."""

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Runtime]:
        """Run the resources and the hub for the ``async with`` block (see the module doc)."""
        async with contextlib.AsyncExitStack() as stack:
            for resource in self._resources:
                await stack.enter_async_context(resource)
            async with self.hub.running():
                yield self
            for backend in set(self.backends.values()):
                await backend.aclose()
            if isinstance(self.log, RedisEventLog):
                await self.log.client.aclose()

    def _render_followed(self, stream_id: str, meta: RenderMeta | None) -> None:
        """A stream another replica runs is mirrored here: cache its frames in its dialect."""
        if meta is not None:
            self.frames.encode_as(stream_id, encoder_for(meta, stream_id))

    async def drain(self, timeout_s: float) -> None:
        """Set :attr:`shutdown`, then drain the hub: new streams are refused, live ones get
        ``timeout_s`` to finish (see :meth:`StreamHub.drain`)."""
        self.shutdown.set()
        await self.hub.drain(timeout_s)

    def end_live_streams(self) -> int:
        """End every live stream now with a retryable error; how many there were."""
        self.shutdown.set()
        return self.hub.end_live_streams()
