"""How many torch threads the engine's steps run on, tuned by timing the steps themselves.

The right number depends on what else the machine runs, and changes with it. On this
2-core VM a 64-sequence step of ``sluice-tiny`` took 10.6 ms on two threads and 17.3 ms on
one when the machine was otherwise quiet, and 24.0 ms on two against 16.8 ms on one with a
single busy process beside it: every parallel section waits for its slowest thread, and a
thread the scheduler took away makes the whole step wait. Neither fixed choice is right
for both, so :class:`ThreadGovernor` tries its candidates against each other now and then,
on the live traffic, and keeps the faster until the next trial.

A trial runs blocks of ``block_steps`` counted steps on each candidate in turn, in the
order A B B A (so that a load that grows or shrinks during the trial falls on both sides
alike), and compares each candidate's time per sequence over its blocks. Only steps of
decodes alone count: a step that prefills costs another amount per sequence, and one in a
block would tilt the comparison; such steps run on the trial's current candidate and are
not timed. A trial whose candidates' steps had batches of different sizes on average (by
more than ``COMPARABLE_BATCHES`` times: the load grew or fell under it) decides nothing and
begins again. When the first two blocks already differ by ``DECISIVE`` times or more (two
threads beside a busy process: 1.4-3x slower), the trial ends there, with half the slow
steps. The winner then holds for ``hold_steps`` steps of any kind, and a new trial begins;
a trial that keeps the same count doubles the next hold, up to ``MAX_HOLD_FACTOR`` times,
and one that changes it starts over from ``hold_steps``. The slower setting so runs a few
percent of the steps at first, and less while the machine stays as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

__all__ = ["ThreadGovernor", "cores_but_one", "tuned_threads"]

logger = logging.getLogger(__name__)

# A trial's first two blocks that differ by this factor decide it at once.
DECISIVE = 1.25
# The candidates' mean batch sizes in a trial may differ by this factor at most; a trial
# whose differ more is dropped and begun again.
COMPARABLE_BATCHES = 1.25
# A hold doubles while trials keep the same count, up to this many times hold_steps.
MAX_HOLD_FACTOR = 8


class ThreadGovernor:
    """Sets the process's torch threads before each engine step (``before_step``) and learns
    from each step's time (``after_step``). One candidate: it only sets it, once."""

    def __init__(
        self,
        candidates: Sequence[int],
        *,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        block_steps: int = 8,
        hold_steps: int = 512,
    ) -> None:
        choices = sorted(set(candidates))
        if not choices or choices[0] < 1:
            raise ValueError(f"candidates must be thread counts of at least 1, got {candidates}")
        if block_steps < 1 or hold_steps < 1:
            raise ValueError("block_steps and hold_steps must be at least 1")
        self.candidates: tuple[int, ...] = tuple(choices)
        self._set_threads = set_threads
        self._block_steps = block_steps
        self._hold_steps = hold_steps
        self.threads = choices[-1]  # the current choice (before any trial: the most)
        self._applied: int | None = None
        self._trial: list[int] = []  # the candidate of each counted step still to come
        self._spent: dict[int, list[float]] = {}  # candidate -> [seconds, sequences, steps]
        self._held = 0  # steps since the last trial ended
        self.hold = hold_steps  # steps the current choice holds before the next trial
        self.num_trials = 0  # trials completed
        self.num_inconclusive = 0  # trials dropped: the batch sizes differed too much
        if len(choices) > 1:
            self._begin_trial()

    def before_step(self) -> None:
        """Set the threads this step runs on (only when they change)."""
        wanted = self._trial[0] if self._trial else self.threads
        if wanted != self._applied:
            self._set_threads(wanted)
            self._applied = wanted

    def after_step(self, num_prefill_tokens: int, num_decodes: int, duration_s: float) -> None:
        """Learn from the step that just ran (its prefill tokens, its decodes, its time)."""
        if len(self.candidates) == 1:
            return
        if not self._trial:
            self._held += 1
            if self._held >= self.hold:
                self._begin_trial()
            return
        if num_prefill_tokens or not num_decodes:
            return  # not comparable: see the module
        spent = self._spent[self._trial.pop(0)]
        spent[0] += duration_s
        spent[1] += num_decodes
        spent[2] += 1
        if len(self._trial) == 2 * self._block_steps and self._comparable():  # A once, B once
            costs = sorted(self._costs().values())
            if costs[1] >= DECISIVE * costs[0]:
                self._trial.clear()
        if not self._trial:
            if self._comparable():
                self._end_trial()
            else:  # the load changed under the trial: it says nothing; another one
                self.num_inconclusive += 1
                self._begin_trial()

    def _begin_trial(self) -> None:
        first, second = self.candidates[0], self.candidates[-1]
        block = self._block_steps
        self._trial = [first] * block + [second] * 2 * block + [first] * block
        self._spent = {first: [0.0, 0.0, 0], second: [0.0, 0.0, 0]}

    def _comparable(self) -> bool:
        """Whether the candidates' steps so far had about the same sequences on average (a
        step's time per sequence falls as its batch grows: a ramp of the load between
        the blocks would decide the trial, not the threads)."""
        sizes = sorted(sequences / steps for _, sequences, steps in self._spent.values())
        return sizes[1] <= COMPARABLE_BATCHES * sizes[0]

    def _costs(self) -> dict[int, float]:
        """Each candidate's seconds per sequence in the trial so far."""
        return {c: seconds / sequences for c, (seconds, sequences, _) in self._spent.items()}

    def _end_trial(self) -> None:
        costs = self._costs()
        best = min(costs, key=lambda c: costs[c])
        kept = best == self.threads and self.num_trials > 0  # the first one finds, not keeps
        self.hold = (
            min(2 * self.hold, MAX_HOLD_FACTOR * self._hold_steps) if kept else self._hold_steps
        )
        if best != self.threads:
            logger.info(
                "engine threads: %d (%.3f ms a sequence, against %s)",
                best,
                costs[best] * 1e3,
                ", ".join(f"{c}: {cost * 1e3:.3f} ms" for c, cost in costs.items() if c != best),
            )
        self.threads = best
        self._held = 0
        self.num_trials += 1


def cores_but_one() -> int:
    """The cores this process may use, less one (at least 1): a fixed count that leaves an
    event loop sharing the process its core."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def tuned_threads() -> ThreadGovernor:
    """A governor that tunes between :func:`cores_but_one` and every core this process may
    use (``--engine-threads auto`` in the engine's own process)."""
    return ThreadGovernor((cores_but_one(), len(os.sched_getaffinity(0))))
