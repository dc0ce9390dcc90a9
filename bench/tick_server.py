"""``sluice serve`` with a timestamping backend, for the latency benchmark (bench only).

``TickBackend`` implements the :class:`sluice.backends.base.Backend` protocol. Each of its
generations yields one delta per period on a fixed-rate schedule (like the ssebench peers'
``_tick``): the delta text is ``"<emit_ns> <seq> <due_ns>"``, where ``emit_ns`` is
``time.monotonic_ns()`` just before the delta is handed to the hub and ``due_ns`` is when
the tick was scheduled. Late ticks go out at once, none is dropped. The generation runs
until the hub aborts it (its reader left and the grace window ended), or for
``max_tokens`` ticks when a request sets it.

The launcher runs the real ``sluice serve`` command (same options, same ``uvicorn.Config``)
with one change: the app is built with the tick backend registered under the model name
``words``. So ``GET /v1/demo/words?text=tick&interval_ms=20`` runs our real SSE path
(hub, producer task, event log with ids, native JSON encoding at append,
``sluice.transports.sse.CallbackSSE``) with 50 timestamped ``token`` events per
second, and one URL per stream is all a load generator needs.

Run: ``python bench/tick_server.py --port 8001 --log-level warning [sluice serve options]``
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING

import sluice.cli
from sluice.backends.base import Backend, Delta, GenerationRequest
from sluice.events import FinishReason, TextDelta, Usage
from sluice.gateway.app import SluiceApp, create_app
from sluice.gateway.auth import Auth
from sluice.gateway.settings import Settings

if TYPE_CHECKING:
    from sluice.rollout.controller import Rollouts

__all__ = ["TickBackend", "TickGeneration", "main"]

_now_ns = time.monotonic_ns
# Used when a request asks for no pacing (interval 0): 50 ticks per second.
_DEFAULT_PERIOD_NS = 20_000_000


def _delta(text: str, reason: FinishReason | None) -> Delta:
    """One token of ``text`` as a :class:`Delta`."""
    return Delta(events=(TextDelta(text),), finish_reason=reason)


class TickGeneration:
    """Timestamped ticks at a fixed rate: ``"<emit_ns> <seq> <due_ns>"``."""

    def __init__(self, request: GenerationRequest) -> None:
        self._period_ns = int(request.interval_s * 1e9) or _DEFAULT_PERIOD_NS
        self._count = request.max_tokens or 0  # 0: until aborted
        self._num_emitted = 0
        self._aborted = False

    async def start(self) -> None:
        """Nothing to admit: the text is already here."""

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        period, count = self._period_ns, self._count
        due = _now_ns()
        seq = 0
        while not self._aborted:
            seq += 1
            self._num_emitted = seq
            last = seq == count
            yield _delta(f"{_now_ns()} {seq} {due}", FinishReason.LENGTH if last else None)
            if last:
                return
            due += period
            delay = due - _now_ns()
            # Behind schedule (overloaded): late ticks go out at once, none is dropped.
            await asyncio.sleep(delay / 1e9 if delay > 0 else 0)

    async def abort(self) -> None:
        self._aborted = True

    def usage(self) -> Usage:
        return Usage(prompt_tokens=0, completion_tokens=self._num_emitted)


class TickBackend:
    """Serves timestamped ticks under a model name (``words`` in this launcher)."""

    def __init__(self, model: str = "words") -> None:
        self._model = model

    @property
    def model(self) -> str:
        return self._model

    def generate(self, request: GenerationRequest) -> TickGeneration:
        return TickGeneration(request)

    async def aclose(self) -> None:
        return None


def create_tick_app(
    settings: Settings | None = None,
    backends: Mapping[str, Backend] | None = None,
    resources: Sequence[contextlib.AbstractAsyncContextManager[object]] = (),
    auth: Auth | None = None,
    rollouts: Rollouts | None = None,
) -> SluiceApp:
    """``create_app`` with the ``words`` model served by :class:`TickBackend` (run with
    ``--no-model``: other backends are served beside it)."""
    served: dict[str, Backend] = {**(backends or {}), "words": TickBackend("words")}
    return create_app(settings, served, resources, auth, rollouts)


def main(argv: Sequence[str] | None = None) -> int:
    """``sluice serve`` (same parser, settings and uvicorn options) with the tick app."""
    # sluice.cli.serve builds its app with the module-level name ``create_app``: point it
    # at the tick app so everything else is exactly what ``sluice serve`` does.
    sluice.cli.create_app = create_tick_app  # type: ignore[assignment]
    return sluice.cli.main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
