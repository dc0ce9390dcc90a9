"""Several engine processes behind one driver: ``sluice serve --engine-replicas N``.

On a small CPU machine an engine whose steps run on every core loses most when the server
and its clients need a share of those cores: each of a step's parallel sections waits for
its slowest thread, so a thread the scheduler hands to the server for a millisecond holds
its sibling spinning for as long (served at 64 streams on 2 cores, a 9.9 ms step took
13.3 ms). Two engines of one thread each have no sections to wait in: whichever the
scheduler interrupts, the other goes on. Each replica is a
:class:`~sluice.engine_process.ProcessEngine` with its share of the KV cache and of the
running sequences; what it costs is the model loaded once per replica, a prefix cache per
replica, and one request's steps on fewer cores (see ``README.md``).

:class:`EngineReplicas` is driven like one engine (the backend's ``EngineDriver``): a new
request goes to the replica with the fewest live requests (ties in turn), and its id is
made unique across replicas (``local id * N + replica``), so an abort finds its replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar, cast

from sluice.engine.driver import RequestStream
from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.outputs import StepStats
from sluice.engine.sampling_params import SamplingParams
from sluice.engine_process.driver import ProcessEngine
from sluice.engine_process.wire import EngineInfo

__all__ = ["EngineReplicas", "merge_stats"]

T = TypeVar("T")

# Stats that are a rate or a setting of each replica, not a count: their mean is reported.
_MEAN_STATS = frozenset({"spec_decode_acceptance_pct", "spec_decode_k"})


class EngineReplicas:
    """``replicas`` (started, not yet entered) as one engine; use as ``async with``."""

    def __init__(self, replicas: Sequence[ProcessEngine]) -> None:
        if not replicas:
            raise ValueError("need at least one replica")
        self._replicas = tuple(replicas)
        self._turn = itertools.cycle(range(len(replicas)))
        self._stack: contextlib.AsyncExitStack | None = None

    @property
    def replicas(self) -> tuple[ProcessEngine, ...]:
        return self._replicas

    @property
    def info(self) -> EngineInfo:
        return self._replicas[0].info

    @property
    def config(self) -> EngineConfig:
        """The replicas' limits together: their sequences, blocks, step budgets and queues
        add up; a request's length is one replica's."""
        configs = [replica.config for replica in self._replicas]
        return dataclasses.replace(
            configs[0],
            num_blocks=sum(c.num_blocks for c in configs),
            max_num_seqs=sum(c.max_num_seqs for c in configs),
            max_num_batched_tokens=sum(c.max_num_batched_tokens for c in configs),
            max_waiting=sum(c.max_waiting for c in configs),
            max_model_len=min(c.max_model_len for c in configs),
        )

    def set_step_observer(self, observer: Callable[[StepStats], None] | None) -> None:
        for replica in self._replicas:
            replica.set_step_observer(observer)

    async def __aenter__(self) -> EngineReplicas:
        async with contextlib.AsyncExitStack() as stack:
            for replica in self._replicas:
                await stack.enter_async_context(replica)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    def _pick(self) -> int:
        """The running replica with the fewest live requests, among equals the next in turn
        (one being started again after its process died is passed over while another
        runs; with none running, the next in turn refuses the request: a ``503``)."""
        running = [replica.is_running for replica in self._replicas]
        if not any(running):
            return next(self._turn)
        fewest = min(r.num_live for r, up in zip(self._replicas, running, strict=True) if up)
        for _ in self._replicas:
            index = next(self._turn)
            if running[index] and self._replicas[index].num_live == fewest:
                return index
        raise AssertionError("no replica has the fewest live requests")  # pragma: no cover

    async def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Queue a request on the least busy replica; its admission errors are raised here."""
        index = self._pick()
        stream = await self._replicas[index].add_request(prompt_token_ids, params)
        return stream.renamed(stream.request_id * len(self._replicas) + index)

    async def abort(self, request_id: int) -> bool:
        """Abort a request (by the id :meth:`add_request` gave) between its replica's steps."""
        count = len(self._replicas)
        return await self._replicas[request_id % count].abort(request_id // count)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn`` on every replica's engine; their results must be stats (``dict`` of
        ints), which come back merged (:func:`merge_stats`)."""
        results = [await replica.call(fn) for replica in self._replicas]
        if not all(isinstance(result, dict) for result in results):
            raise TypeError("replicas merge only stats: dicts of ints")
        return cast(T, merge_stats(cast(list[dict[str, int]], results)))


def merge_stats(stats: Sequence[dict[str, int]]) -> dict[str, int]:
    """The replicas' engine stats as one engine's: counts added up (queues, blocks, hits,
    threads), rates and settings averaged (speculation's acceptance and ``k``)."""
    merged: dict[str, int] = {}
    for key in dict.fromkeys(key for one in stats for key in one):
        values = [one[key] for one in stats if key in one]
        merged[key] = round(sum(values) / len(values)) if key in _MEAN_STATS else sum(values)
    return merged
