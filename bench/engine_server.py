"""``sluice serve`` with an engine-shaped backend, for the engine fan-out test (bench only).

``StepBackend`` implements the :class:`sluice.backends.base.Backend` protocol the way the
real engine backend meets it: each generation has an ``asyncio.Queue`` of outputs (the
engine driver's sink) and yields one :class:`~sluice.backends.base.Delta` per output;
the outputs come from ONE :class:`step_clock.StepClock` shared by every live generation,
which every 20 ms gives each of them its next token, ``"<emit_ns> <seq> <due_ns> "``. A
generation joins the clock in ``start()``, leaves it after its ``max_tokens``-th token
(the last delta says ``length``) or when aborted; with no ``max_tokens`` it runs until
aborted.

The launcher runs the real ``sluice serve`` command (same options, same
``uvicorn.Config``) with one change, as ``tick_server.py`` does: the model ``words`` is
served by ``StepBackend``. So ``GET /v1/demo/words?text=tick&max_tokens=K`` runs our real
SSE path (hub, producer task per stream, event log, frame cache (native JSON encoding at
append), ``sluice.transports.sse.CallbackSSE``) for K tokens, 50 per second, that arrive
for every stream at once. The demo's ``interval_ms`` is ignored: the clock sets the pace.

Run: ``python bench/engine_server.py --port 8001 --log-level warning [sluice serve options]``
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING

import sluice.cli
from sluice.backends.base import Backend, Delta, GenerationRequest
from sluice.backends.words import WordsBackend
from sluice.events import FinishReason, TextDelta, Usage
from sluice.gateway.app import SluiceApp, create_app
from sluice.gateway.auth import Auth
from sluice.gateway.settings import Settings
from step_clock import StepClock, token_text

if TYPE_CHECKING:
    from sluice.rollout.controller import Rollouts

__all__ = ["StepBackend", "StepGeneration", "create_step_app", "main"]

# A queue item: the token's text and whether it is the generation's last; None: aborted.
_Output = tuple[str, bool] | None


class StepGeneration:
    """Tokens handed over by the shared clock, one delta each."""

    def __init__(self, clock: StepClock, request: GenerationRequest) -> None:
        self._clock = clock
        self._count = request.max_tokens or 0  # 0: until aborted
        # Holds what the clock produced and the producer task has not taken yet: at most
        # max_tokens items (the server clamps max_tokens to --max-tokens-per-stream).
        self._outputs: asyncio.Queue[_Output] = asyncio.Queue()
        self._num_emitted = 0
        self._joined = False
        self._aborted = False

    def step(self, due_ns: int) -> bool:
        """The clock's call: queue the next token; False after the last one."""
        self._num_emitted += 1
        seq = self._num_emitted
        last = seq == self._count
        self._outputs.put_nowait((token_text(seq, due_ns), last))
        return not last

    async def start(self) -> None:
        """Join the clock: the first token comes at its next step."""
        if not self._joined and not self._aborted:
            self._joined = True
            self._clock.join(self)

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        await self.start()
        try:
            while not self._aborted:
                output = await self._outputs.get()
                if output is None:
                    return
                text, last = output
                yield Delta(
                    events=(TextDelta(text),), finish_reason=FinishReason.LENGTH if last else None
                )
                if last:
                    return
        finally:
            self._clock.leave(self)

    async def abort(self) -> None:
        self._aborted = True
        self._clock.leave(self)
        self._outputs.put_nowait(None)  # wakes a producer waiting for its next token

    def usage(self) -> Usage:
        return Usage(prompt_tokens=0, completion_tokens=self._num_emitted)


class StepBackend:
    """Serves clock-stepped tokens under a model name (``words`` in this launcher)."""

    def __init__(self, model: str = "words", clock: StepClock | None = None) -> None:
        self._model = model
        self._clock = clock or StepClock()

    @property
    def model(self) -> str:
        return self._model

    def generate(self, request: GenerationRequest) -> StepGeneration:
        return StepGeneration(self._clock, request)

    async def aclose(self) -> None:
        await self._clock.aclose()


def create_step_app(
    settings: Settings | None = None,
    backends: Mapping[str, Backend] | None = None,
    resources: Sequence[contextlib.AbstractAsyncContextManager[object]] = (),
    auth: Auth | None = None,
    rollouts: Rollouts | None = None,
) -> SluiceApp:
    """``create_app`` with the ``words`` model served by :class:`StepBackend` (run with
    ``--no-model``: other backends are served beside it), and the real ``words`` backend
    as ``idle`` (paced by ``interval_ms``: streams that wait, for memory figures)."""
    served: dict[str, Backend] = {
        **(backends or {}),
        "words": StepBackend("words"),
        "idle": WordsBackend("idle"),
    }
    return create_app(settings, served, resources, auth, rollouts)


def main(argv: Sequence[str] | None = None) -> int:
    """``sluice serve`` (same parser, settings and uvicorn options) with the step app."""
    # sluice.cli.serve builds its app with the module-level name ``create_app``: point it
    # at the step app so everything else is exactly what ``sluice serve`` does.
    sluice.cli.create_app = create_step_app  # type: ignore[assignment]
    return sluice.cli.main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
