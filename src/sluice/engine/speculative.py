"""Speculative decoding's plan: its configuration, prompt-lookup drafting, the choice of ``k``
per step and its counters. Pure Python (no torch): tested on the CPU.

Per step a proposer drafts up to ``k`` tokens after each decoding sequence's last one, the
target scores them all in one pass (:meth:`~sluice.engine.model_runner.ModelRunner.verify`)
and :mod:`~sluice.engine.acceptance` keeps what the target would have produced itself.

**Prompt lookup** (n-gram drafting, for any model): the longest suffix of the sequence (up
to ``ngram_max`` tokens, at least ``ngram_min``) that occurred before, most recent
occurrence first; the draft is what followed that occurrence.

**Adaptive k** (:class:`AdaptiveK`). Speculation pays when a step's cost grows slower than
its expected output: with ``a_i`` the measured rate at which draft position ``i`` is
accepted after positions ``1 .. i - 1`` were (the mean of the first verifies with the prior
counting as one, then over about the last 50), a step of ``k`` yields ``E(k) = 1 + a_1 + a_1
a_2 + ...`` tokens per sequence, and costs ``cost(b, k)`` seconds at ``b`` decoding
sequences (measured online, per power-of-two bucket of ``b``, on steady steps: decodes only,
at least 3/4 of ``k`` drafts a sequence, no catch-up, and not the first step at that bucket
and ``k``, which pays one-off costs; the fastest of the last 3, other work on the machine
only ever adding time). A step's cost grows with its sequences' context (at 16 streams of
the bundled pair, 0.3-0.4% a token: the last quarter of a 128-token answer's steps cost 38%
more than its first), so each sample is carried to the context of now along the growth the
bucket's steps show (the slope of the log of their cost against their mean context, within
each ``k``), and only a ``k`` measured in the last ``explore_every`` steps of the bucket can
be the best. Each step takes the ``k`` (0: off) of the highest ``E(k) / cost(b, k)``. A
bucket climbs: ``k + 1`` is first tried when ``k`` scores best so far, or, in a batch of at
most four, less than 25% behind the best (a step's fixed costs can make ``k = 1`` lose where
``k = 3`` wins); in a wider batch, where each drafted token costs about as much as the last,
past ``k = 1`` only while it scores 15% better than none; a ``k`` whose steps stay
unmeasured for 12 steps (prompt lookup finding no matches) is given up until the next look.
A larger ``k`` must score 5% better than a smaller one, and in a batch of more than four
speculation 15% better than none (what the score leaves out, sequences finishing steps apart
and the draft catching up on new prompts, cost 10-20% at 16 streams). ``explore_every``
steps after the best last changed, the less recently measured neighbour of the best is
looked at again for 3 steady steps (then ever less often while the best holds, up to 16
times further apart), so a change of load or acceptance is seen. A bucket neither climbs nor
explores past the ``k`` that scores best at the nearest smaller bucket that has finished its
climb over at least ``explore_every`` steps: drafts and verify cost more against a plain
decode the more sequences a step holds, so what does not pay at 16 streams does not pay at
64 (measured on the bundled pair, a bucket of 64 learning that on its own cost its first
128-token batch 16%).

A draft model that did not run for a while catches up on every token since in its next
step (new sequences: on their prompts), a one-off cost that is not a step cost (not a
sample) but the cost of switching on: its cost per token is measured on those steps (the
time of the proposer's catch-up pass, else what the step took beyond a step at its ``k``), and
with ``num_behind`` tokens to catch up a ``k`` that scores best is taken only if what it
saves over ``explore_every`` steps pays for the catch-up (at 64 streams one cost as much as
five steps, and speculation saved a few percent a step), and a look at ``k = 1`` from no
speculation is skipped while the catch-up would be more than 5% of the steps since the last
look: on one stream it never is; at 64 streams, where the draft falls 64 tokens behind a
step, it always is, so speculation that settled off there stays off.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "AdaptiveK",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "propose_ngram",
]

SpeculativeMethod = Literal["draft", "ngram"]

# The weight of a sequence's verify in the running acceptance rates: about the last 50
# verifies count. Acceptance varies a lot from one verify to the next; with a weight of 0.1
# (the last 10) E(k) swung by a third on the bundled pair and took 4 streams from k = 4
# (1.36x of no speculation at a fixed k) to off.
_SAMPLE_WEIGHT = 0.02
# Steps of a bucket at one k before its cost counts as measured; the estimate is the
# fastest of the last this many (see _Cost), and a look at a neighbour of the best k takes
# this many steady steps.
_MIN_COST_SAMPLES = 3
# A look ends after this many steps even when they were not all steady (catch-ups, steps
# drafting well under k).
_MAX_LOOK_STEPS = 4 * _MIN_COST_SAMPLES
# Catch-up costs kept (their minimum is the estimate).
_NUM_CATCH_UP_COSTS = 8
# Steady steps of a bucket its cost's growth with context is fitted over, and the most
# that growth is taken to be per token of context (measured on the bundled pair at a fixed
# k: 0.34-0.44% a token at 16 and 64 streams, whatever k; learnt online, 0.2-0.6% there and
# 0.03-0.1% at one stream).
_GROWTH_SAMPLES = 64
_MAX_GROWTH = 0.05
# Samples between fresh sums of the growth fit (its running sums, made again from the
# window so that rounding cannot pile up).
_GROWTH_RESUM_EVERY = 1024
# A larger k must score this much better than a smaller one: step costs are noisy, and the
# smaller k is the cheaper mistake.
_MARGIN = 1.05
# Re-exploring a bucket whose best held is done ever less often, up to this many times
# ``explore_every`` apart: after a long run without drafts, a draft model's first verify
# catches up on every token since, which is what an exploration step then costs.
_MAX_EXPLORE_BACKOFF = 16
# Neighbours this much behind the best are re-explored at the longest interval at once.
_CLEAR_LOSS = 1.25
# An exploration from no speculation is skipped while the draft model's catch-up it costs
# is more than this share of the steps since the last exploration.
_MAX_EXPLORE_SHARE = 0.05
# A draft position's acceptance rate before any verify: the draft is worth trying.
_PRIOR_ACCEPTANCE = 0.6
# Batches of more decodes than this draft at most _WIDE_MAX_K tokens a sequence. Each k is
# climbed to and measured before it can be judged, and a wide batch's verify and drafts
# cost the most: measured on the bundled pair (bench/speculative.py, 2026-12-03), allowing
# k up to 6 took one stream from 2.0x to 2.4x of no speculation and 4 streams from 0.97-1.22x
# to 1.16x, but 64 streams from 0.96x to 0.82x.
_WIDE_BATCH = 4
_WIDE_MAX_K = 4
# In a wider batch speculation must score this much better than none to be switched on.
# The score weighs steady steps; measured on the bundled pair at 16 streams, a k = 1 that
# scored a few percent better than none made 0.80-0.90x of its tokens/s: the batch's
# sequences finish steps apart (acceptance differs between them) and the last run on in
# small steps, and the draft catches up on every new prompt.
_WIDE_SWITCH_ON = 1.15


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates; :class:`ValueError` for values that cannot hold.

    ``method`` is ``"draft"`` (a draft model, given to the engine) or ``"ngram"`` (prompt
    lookup). ``num_speculative_tokens`` is the most tokens drafted per sequence and step.
    ``adaptive`` chooses ``k`` per step (:class:`AdaptiveK`); without it every step drafts
    ``num_speculative_tokens``.
    """

    method: SpeculativeMethod
    num_speculative_tokens: int
    ngram_min: int = 1
    ngram_max: int = 4
    adaptive: bool = True
    explore_every: int = 64

    def __post_init__(self) -> None:
        if self.method not in ("draft", "ngram"):
            raise ValueError(f"method must be 'draft' or 'ngram', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        if self.explore_every < 2:
            raise ValueError(f"explore_every must be at least 2, got {self.explore_every}")


def propose_ngram(
    token_ids: Sequence[int], num_tokens: int, *, ngram_min: int = 1, ngram_max: int = 4
) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``token_ids`` of ``ngram_min .. ngram_max`` tokens; [] when none recurs."""
    length = len(token_ids)
    if num_tokens < 1:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = list(token_ids[length - n :])
        first = suffix[0]
        # The latest start before the suffix itself, scanning back.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start] == first and list(token_ids[start : start + n]) == suffix:
                follow = list(token_ids[start + n : start + n + num_tokens])
                if follow:
                    return follow
    return []


@dataclass
class SpecDecodeStats:
    """Counters since the engine was made (vLLM's ``spec_decode`` metrics).

    ``num_drafts`` counts sequence-steps that drafted at least one token;
    ``num_draft_tokens`` the tokens drafted; ``num_accepted_tokens`` those the target
    kept; ``num_accepted_tokens_per_pos[i]`` / ``num_draft_tokens_per_pos[i]`` is the
    acceptance rate of draft position ``i + 1``. ``num_emitted_tokens`` counts every token
    the speculative steps produced (accepted plus corrections and bonuses).
    """

    method: str
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    last_k: int = 0  # the k of the last step

    def __post_init__(self) -> None:
        if not self.num_draft_tokens_per_pos:
            self.num_draft_tokens_per_pos = [0] * self.num_speculative_tokens
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [
            accepted / drafted if drafted else 0.0
            for accepted, drafted in zip(
                self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos, strict=True
            )
        ]

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verify: ``num_drafted`` tokens drafted, the first ``num_accepted``
        kept (then one more emitted)."""
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        for position in range(num_drafted):
            self.num_draft_tokens_per_pos[position] += 1
            if position < num_accepted:
                self.num_accepted_tokens_per_pos[position] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.method,
            self.num_speculative_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            self.num_emitted_tokens,
            list(self.num_draft_tokens_per_pos),
            list(self.num_accepted_tokens_per_pos),
            self.last_k,
        )


@dataclass(slots=True)
class _Cost:
    """The last few steady step costs at one bucket and ``k``: each with the bucket's step
    count and the mean context per sequence when it was measured. The estimate is the
    fastest recent one, carried to the context of now along the bucket's measured growth
    (see _Growth): other work on the machine only ever adds time to a step, so the fastest
    recent step is the closest to what the step itself costs, and two ``k`` measured at
    different moments compare fairly. Only samples at most ``max_age`` steps old count (the
    latest when none is)."""

    recent: deque[tuple[int, float, float]] = field(
        default_factory=lambda: deque(maxlen=_MIN_COST_SAMPLES)
    )
    num_samples: int = 0
    last_step: int = 0  # the bucket's step count when it was last measured
    warm: bool = False  # its first steady step ran (and was no sample)
    num_unmeasured: int = 0  # steps at it since its last sample that were none

    def seconds(self, step: int, max_age: int, context: float, growth: float) -> float:
        carried = [
            seconds * math.exp(growth * (context - then))
            for at, seconds, then in self.recent
            if step - at <= max_age
        ]
        if carried:
            return min(carried)
        _, seconds, then = self.recent[-1]
        return seconds * math.exp(growth * (context - then))

    def fresh(self, step: int, max_age: int) -> bool:
        return bool(self.recent) and step - self.recent[-1][0] <= max_age


@dataclass(slots=True)
class _Growth:
    """How a bucket's step cost grows with its sequences' context: the slope of the log of
    the cost against the mean context per sequence, fitted over the bucket's last steady
    steps, within each ``k`` (a ``k``'s own steps differ in little but their context).

    The fit keeps running sums per ``k`` (count, x, y, x^2, xy) over the window, so a
    sample costs a few additions, not a refit of the window (which cost ~30 us a step);
    the sums are made again from the window now and then, so that rounding cannot pile up.
    """

    samples: deque[tuple[int, float, float]] = field(default_factory=deque)
    sums: dict[int, list[float]] = field(default_factory=dict)
    num_added: int = 0
    per_token: float = 0.0

    def add(self, k: int, context: float, seconds: float) -> None:
        sample = (k, context, math.log(max(seconds, 1e-12)))
        self.samples.append(sample)
        self._count(sample, 1.0)
        if len(self.samples) > _GROWTH_SAMPLES:
            self._count(self.samples.popleft(), -1.0)
        self.num_added += 1
        if self.num_added % _GROWTH_RESUM_EVERY == 0:
            self.sums = {}
            for old in self.samples:
                self._count(old, 1.0)
        covariance = variance = 0.0
        for n, sum_x, sum_y, sum_xx, sum_xy in self.sums.values():
            if n > 0:
                covariance += sum_xy - sum_x * sum_y / n
                variance += sum_xx - sum_x * sum_x / n
        # A step's cost never shrinks as its context grows; past the cap is noise.
        slope = covariance / variance if variance > 1e-9 else 0.0
        self.per_token = min(_MAX_GROWTH, max(0.0, slope))

    def _count(self, sample: tuple[int, float, float], sign: float) -> None:
        k, x, y = sample
        sums = self.sums.setdefault(k, [0.0, 0.0, 0.0, 0.0, 0.0])
        sums[0] += sign
        sums[1] += sign * x
        sums[2] += sign * y
        sums[3] += sign * x * x
        sums[4] += sign * x * y


class AdaptiveK:
    """Chooses each step's ``k`` from measured acceptance and step costs (module docstring).

    The engine calls :meth:`choose` before a step of ``num_decodes`` decoding sequences and
    :meth:`observe` after it; :meth:`accepted` for each sequence's verify.
    """

    def __init__(self, max_k: int, *, explore_every: int = 64) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be at least 1, got {max_k}")
        self.max_k = max_k
        self._explore_every = explore_every
        self.acceptance = [_PRIOR_ACCEPTANCE] * max_k  # of position i after 1 .. i - 1
        self._num_verified = [0] * max_k  # verifies that reached each position
        self._costs: dict[tuple[int, int], _Cost] = {}
        self._num_steps: dict[int, int] = {}
        self._next_explore: dict[int, int] = {}  # per bucket, the step to explore at
        self._backoff: dict[int, int] = {}  # per bucket, explore_every's multiple now
        self._last_best: dict[int, int] = {}
        # Per bucket, the look in progress: its k, that k's sample count and the bucket's
        # step count when it began.
        self._looks: dict[int, tuple[int, int, int]] = {}
        self._growth: dict[int, _Growth] = {}
        # Per bucket that finished climbing, the k of the highest score (before any switch
        # cost): the ceiling of every larger bucket (see _ceiling).
        self._score_best: dict[int, int] = {}
        # The extra cost per token of the last few catch-ups (their minimum is the estimate).
        self._catch_up_costs: deque[float] = deque(maxlen=_NUM_CATCH_UP_COSTS)

    @staticmethod
    def bucket(num_decodes: int) -> int:
        """The power of two at or above ``num_decodes``: the steps whose costs are pooled."""
        return 1 << max(0, num_decodes - 1).bit_length()

    def expected_tokens(self, k: int) -> float:
        """``E(k)``: tokens per sequence a step of ``k`` drafts yields."""
        total, chain = 1.0, 1.0
        for rate in self.acceptance[:k]:
            chain *= rate
            total += chain
        return total

    def choose(self, num_decodes: int, num_behind: int = 0, context: float = 0.0) -> int:
        """This step's ``k`` for ``num_decodes`` decoding sequences (0: do not speculate) of
        ``context`` tokens each on average, whose draft model would first catch up on
        ``num_behind`` tokens beyond one each."""
        if num_decodes == 0:
            return 0
        bucket = self.bucket(num_decodes)
        scores: dict[int, float] = {}
        step = self._num_steps.get(bucket, 0)
        max_k = self.max_k if bucket <= _WIDE_BATCH else min(self.max_k, _WIDE_MAX_K)
        max_k = min(max_k, self._ceiling(bucket))
        tolerance = _CLEAR_LOSS if bucket <= _WIDE_BATCH else 1.0
        look = self._looks.get(bucket)
        if look is not None:  # a look at a neighbour of the best goes on for a measurement
            k, num_samples, began = look
            measured = self._costs[bucket, k].num_samples - num_samples >= _MIN_COST_SAMPLES
            if k <= max_k and not measured and step - began < _MAX_LOOK_STEPS:
                return k
            del self._looks[bucket]
        switch_on = _MARGIN if bucket <= _WIDE_BATCH else _WIDE_SWITCH_ON
        for k in range(max_k + 1):
            cost = self._costs.get((bucket, k))
            if cost is None or cost.num_samples < _MIN_COST_SAMPLES:
                # Climb: a k is first tried when the one below it scores best so far, or
                # (in a narrow batch) less than _CLEAR_LOSS behind the best; in a wide one
                # past k = 1 only while speculation clearly pays (see _WIDE_SWITCH_ON).
                bar = max(scores.values(), default=0.0)
                if k >= 2 and bucket > _WIDE_BATCH:
                    bar = max(bar, scores[0] * switch_on)
                climb = k == 0 or (k - 1 in scores and scores[k - 1] * tolerance >= bar)
                if climb and cost is not None and cost.num_unmeasured >= _MAX_LOOK_STEPS:
                    # Tried and not measured (its steps drafted too little, e.g. prompt
                    # lookup without matches): not tried again before the next look.
                    climb = False
                if climb and k and cost is not None and cost.recent:
                    # Measured a little already, and clearly behind: not tried again.
                    partial = self.expected_tokens(k) / self._seconds(cost, bucket, step, context)
                    if bucket > _WIDE_BATCH:
                        bar = max(bar, scores[0] * switch_on)
                    climb = partial * tolerance >= bar
                if climb:
                    return k
                continue
            seconds = self._seconds(cost, bucket, step, context)
            scores[k] = self.expected_tokens(k) / max(seconds, 1e-12)
        # Only a k measured lately can be the best: one measured on shorter contexts looks
        # cheaper than it is now (a look at a neighbour measures it again).
        fresh = [k for k in scores if self._costs[bucket, k].fresh(step, self._explore_every)]
        best = min(fresh or scores)
        for k in sorted(fresh or scores):
            if scores[k] > scores[best] * (_MARGIN if best else switch_on):
                best = k
        self._score_best[bucket] = best
        # The catch-up, in the bucket's per-sequence terms as the costs are.
        per_token_s = min(self._catch_up_costs, default=0.0)
        catch_up_s = per_token_s * num_behind / num_decodes * bucket
        if best and not self._pays_to_switch(bucket, best, step, context, catch_up_s):
            best = 0
        if self._last_best.get(bucket) != best:  # the best moved: explore at the base rate
            self._last_best[bucket] = best
            self._backoff[bucket] = 1
            self._next_explore[bucket] = step + self._explore_every
        elif step >= self._next_explore.get(bucket, 0):
            for (at, _), cost in self._costs.items():
                if at == bucket:
                    cost.num_unmeasured = 0  # climbed to again
            neighbours = [k for k in (best - 1, best + 1) if k in scores]
            since_last = self._explore_every * self._backoff.get(bucket, 1)
            backoff = 2 * self._backoff.get(bucket, 1)
            if all(scores[k] * _CLEAR_LOSS < scores[best] for k in neighbours):
                backoff = _MAX_EXPLORE_BACKOFF  # far behind: not worth a look soon
            self._backoff[bucket] = min(_MAX_EXPLORE_BACKOFF, backoff)
            interval = self._explore_every * self._backoff[bucket]
            self._next_explore[bucket] = step + interval
            # From no speculation, a look at k=1 costs the draft's catch-up: not worth it
            # while that is more than a share of the steps since the last look.
            if best == 0:
                budget_s = (
                    _MAX_EXPLORE_SHARE
                    * since_last
                    * self._seconds(self._costs[bucket, 0], bucket, step, context)
                )
                if catch_up_s > budget_s:
                    return best
            if neighbours:
                k = min(neighbours, key=lambda k: self._costs[bucket, k].last_step)
                self._looks[bucket] = (k, self._costs[bucket, k].num_samples, step)
                return k
        return best

    def _ceiling(self, bucket: int) -> int:
        """The most ``k`` worth a look at ``bucket``: what scores best at the nearest smaller
        bucket that finished climbing over at least ``explore_every`` steps (``max_k`` when
        none has; a bucket seen for a few steps, between larger batches, may have judged
        on noise). A step's verify and drafts cost more against a plain decode the more
        sequences it holds, so a ``k`` that does not pay at a smaller batch does not pay at
        a larger one, and is not explored there."""
        smaller = bucket >> 1
        while smaller:
            seen = self._num_steps.get(smaller, 0) >= self._explore_every
            if seen and smaller in self._score_best:
                return self._score_best[smaller]
            smaller >>= 1
        return self.max_k

    def _pays_to_switch(
        self, bucket: int, k: int, step: int, context: float, catch_up_s: float
    ) -> bool:
        """Whether ``k``'s saving over ``explore_every`` steps, against no speculation, pays
        for a catch-up of ``catch_up_s`` first."""
        if catch_up_s <= 0:
            return True
        cost_0 = self._seconds(self._costs[bucket, 0], bucket, step, context)
        cost_k = self._seconds(self._costs[bucket, k], bucket, step, context)
        saving_s = self._explore_every * (self.expected_tokens(k) * cost_0 - cost_k)
        return saving_s > catch_up_s

    def observe(
        self,
        num_decodes: int,
        k: int,
        duration_s: float,
        *,
        steady: bool = True,
        num_caught_up: int = 0,
        catch_up_s: float | None = None,
        context: float = 0.0,
    ) -> None:
        """A step of ``num_decodes`` decodes (and no prefill) of ``context`` tokens each on
        average, at ``k``, took ``duration_s``; one that is not ``steady`` (its draft caught up on ``num_caught_up`` tokens beyond
        one a sequence) counts as a step, and its catch-up pass's ``catch_up_s`` (else what
        the step took beyond a step at ``k``) as the catch-up's cost."""
        if num_decodes == 0 or not 0 <= k <= self.max_k:
            return
        bucket = self.bucket(num_decodes)
        step = self._num_steps.get(bucket, 0) + 1
        self._num_steps[bucket] = step
        # Costs per sequence: a bucket pools batches of up to twice each other's size.
        seconds = duration_s / num_decodes * bucket
        if not steady:
            known = self._costs.get((bucket, k)) or self._costs.get((bucket, 0))
            if k:
                self._costs.setdefault((bucket, k), _Cost()).num_unmeasured += 1
            # Only a real catch-up (not a token or two a sequence more than usual, which
            # step-to-step noise would swamp) measures its cost per token.
            if num_caught_up <= 2 * num_decodes:
                return
            if catch_up_s is not None:
                self._catch_up_costs.append(catch_up_s / num_caught_up)
            elif known is not None and known.recent:
                extra = seconds - self._seconds(known, bucket, step, context)
                extra_s = max(0.0, extra) * num_decodes / bucket
                self._catch_up_costs.append(extra_s / num_caught_up)
            return
        cost = self._costs.setdefault((bucket, k), _Cost())
        cost.num_unmeasured = 0
        if not cost.warm:  # the first step of new shapes pays one-off costs
            cost.warm = True
            return
        cost.recent.append((step, seconds, context))
        cost.num_samples += 1
        cost.last_step = step
        self._growth.setdefault(bucket, _Growth()).add(k, context, seconds)

    def _seconds(self, cost: _Cost, bucket: int, step: int, context: float) -> float:
        """``cost``'s estimate at ``context``."""
        growth = self._growth.get(bucket)
        per_token = 0.0 if growth is None else growth.per_token
        return cost.seconds(step, self._explore_every, context, per_token)

    def accepted(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verify: positions ``1 .. num_accepted`` kept, the next rejected."""
        for position in range(min(num_drafted, num_accepted + 1, self.max_k)):
            sample = 1.0 if position < num_accepted else 0.0
            self._num_verified[position] += 1
            # The mean of the first verifies (the prior counting as one), then a running
            # rate: a few verifies replace the prior, however slowly the rate moves later.
            weight = max(_SAMPLE_WEIGHT, 1 / (self._num_verified[position] + 1))
            rate = self.acceptance[position]
            self.acceptance[position] = rate + weight * (sample - rate)
