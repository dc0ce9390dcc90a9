"""The workers of one model, their reported loads, and where the next request goes.

A :class:`WorkerPool` holds one ``grpc.aio`` channel per worker (``sluice worker``, or any
server of vLLM's gRPC engine protocol) and, while it runs (``async with pool.running()``),
one poller task that asks every worker for its load (``GetLoads``) each
``load_interval_s``. A worker that answers is up; one that does not (within
``rpc_timeout_s``) is down until it answers again, and then only if it still serves the
same model (``GetModelInfo``).

Placement (:meth:`WorkerPool.ranked`): the up workers, least loaded first. A worker's load
is what it last reported (running plus waiting requests) corrected by what this gateway did
since the report came in (the streams it started there, less those that ended), and at
least this gateway's live streams there. So a burst of requests spreads over the workers
before the next report, and the load of other gateways (or of clients that call a worker
directly) counts as soon as a report shows it. Ties go to
fewer of this gateway's streams, then round-robin.

:meth:`WorkerPool.connect` bounds the wait for a channel that is not connected yet
(``connect_timeout_s``): a worker that just went away is left for the next one, never
waited on for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Final

import grpc

from sluice.vllm_grpc.client import EngineClient, WorkerDescription
from sluice.vllm_grpc.proto import vllm_engine_pb2 as pb

__all__ = ["Load", "Worker", "WorkerOptions", "WorkerPool"]

logger = logging.getLogger(__name__)

# Keepalive pings on idle channels find a dead worker between polls too.
_KEEPALIVE_S: Final = 15.0


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """How the gateway talks to its workers (all in seconds); :class:`ValueError` else."""

    load_interval_s: float = 0.5  # between two GetLoads of a worker
    rpc_timeout_s: float = 2.0  # GetLoads, GetModelInfo, Abort
    connect_timeout_s: float = 1.0  # a channel's connection, when a request needs it
    deadline_s: float | None = None  # of a Generate call (None: none)
    retry_after_s: float = 1.0  # told to clients when no worker can take a request

    def __post_init__(self) -> None:
        for name in ("load_interval_s", "rpc_timeout_s", "connect_timeout_s", "retry_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s}")


@dataclass(frozen=True, slots=True)
class Load:
    """A worker's ``GetLoads`` answer: requests and KV-cache tokens."""

    num_running: int
    num_waiting: int
    num_used_tokens: int
    max_total_tokens: int

    @classmethod
    def of(cls, response: pb.GetLoadsResponse) -> Load:
        """The sum over the ranks a response reports."""
        loads = response.loads
        return cls(
            num_running=sum(load.num_running_reqs for load in loads),
            num_waiting=sum(load.num_waiting_reqs for load in loads),
            num_used_tokens=sum(load.num_used_tokens for load in loads),
            max_total_tokens=sum(load.max_total_num_tokens for load in loads),
        )


class Worker:
    """One worker: its channel, its last report, and this gateway's streams on it."""

    def __init__(self, description: WorkerDescription) -> None:
        self.description = description
        self.url = description.url
        self._channel: grpc.aio.Channel | None = None
        self._client: EngineClient | None = None
        self.up = True  # it answered at start-up
        self.load: Load | None = None
        # This gateway's streams there, started and ended, in all (the live ones: the
        # difference), and the two counts when the last report came in.
        self.num_started = 0
        self.num_ended = 0
        self._counts_at_report = (0, 0)

    def open(self) -> None:
        """Make its channel, on the running event loop (a channel belongs to one loop)."""
        self._channel = grpc.aio.insecure_channel(
            self.description.target,
            options=(
                ("grpc.keepalive_time_ms", int(_KEEPALIVE_S * 1000)),
                ("grpc.max_receive_message_length", 16 << 20),
            ),
        )
        self._client = EngineClient(self._channel)

    async def close(self) -> None:
        channel, self._channel, self._client = self._channel, None, None
        if channel is not None:
            await channel.close()

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            raise RuntimeError(f"worker {self.url}: its pool is not running")
        return self._channel

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            raise RuntimeError(f"worker {self.url}: its pool is not running")
        return self._client

    @property
    def num_live(self) -> int:
        """This gateway's streams on it now."""
        return self.num_started - self.num_ended

    @property
    def score(self) -> int:
        """Its requests as last reported, plus this gateway's started since the report came
        in, less those ended since; at least this gateway's own live streams (a report
        asked for before a stream started may or may not count it)."""
        reported = 0 if self.load is None else self.load.num_running + self.load.num_waiting
        started, ended = self._counts_at_report
        since = (self.num_started - started) - (self.num_ended - ended)
        return max(0, reported + since, self.num_live)

    def reported(self, load: Load) -> None:
        self.load = load
        self._counts_at_report = (self.num_started, self.num_ended)


class WorkerPool:
    """The workers of one model (see the module)."""

    def __init__(self, descriptions: Sequence[WorkerDescription], options: WorkerOptions) -> None:
        if not descriptions:
            raise ValueError("a worker pool needs at least one worker")
        self.model = descriptions[0].model
        self.options = options
        self.workers = [Worker(description) for description in descriptions]
        self._turn = itertools.count()

    @property
    def num_up(self) -> int:
        return sum(1 for worker in self.workers if worker.up)

    def ranked(self) -> list[Worker]:
        """The up workers, the one the next request should go to first."""
        turn = next(self._turn)
        count = len(self.workers)
        order = {id(worker): (i - turn) % count for i, worker in enumerate(self.workers)}
        up = [worker for worker in self.workers if worker.up]
        return sorted(up, key=lambda w: (w.score, w.num_live, order[id(w)]))

    async def connect(self, worker: Worker) -> bool:
        """Whether the worker's channel is connected, waiting ``connect_timeout_s`` at most
        for it to connect; a worker that does not is marked down."""
        state = worker.channel.get_state(try_to_connect=True)
        if state is grpc.ChannelConnectivity.READY:
            return True
        try:
            async with asyncio.timeout(self.options.connect_timeout_s):
                await worker.channel.channel_ready()
        except TimeoutError:
            self.mark_down(worker, "it did not connect")
            return False
        return True

    def mark_down(self, worker: Worker, why: str) -> None:
        if worker.up:
            logger.warning("worker %s is down: %s", worker.url, why)
        worker.up = False

    async def poll(self, worker: Worker) -> Load | None:
        """Ask one worker for its load now; mark it up or down by its answer."""
        try:
            response = await worker.client.get_loads(
                pb.GetLoadsRequest(), timeout=self.options.rpc_timeout_s
            )
            if not worker.up:  # it came back: is it still the model's?
                info = await worker.client.get_model_info(
                    pb.GetModelInfoRequest(), timeout=self.options.rpc_timeout_s
                )
                if info.served_model_name != self.model:
                    self.mark_down(worker, f"it now serves {info.served_model_name!r}")
                    return None
                logger.info("worker %s is up", worker.url)
                worker.up = True
        except grpc.aio.AioRpcError as exc:
            self.mark_down(worker, f"GetLoads: {exc.code().name}: {exc.details()}")
            return None
        load = Load.of(response)
        worker.reported(load)
        return load

    async def poll_all(self) -> list[Load | None]:
        """Every worker's load now (``None`` for one that did not answer)."""
        return list(await asyncio.gather(*(self.poll(worker) for worker in self.workers)))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[WorkerPool]:
        """Open the channels and poll the workers' loads for the block; close them after."""
        for worker in self.workers:
            worker.open()
        try:
            async with asyncio.TaskGroup() as tasks:
                poller = tasks.create_task(self._poll_forever())
                try:
                    yield self
                finally:
                    poller.cancel()
        finally:
            for worker in self.workers:
                await worker.close()

    async def _poll_forever(self) -> None:
        interval_s = self.options.load_interval_s
        while True:
            started = time.monotonic()
            await self.poll_all()
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
