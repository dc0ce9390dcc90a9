"""Predicting a request's time to first token on the embedded engine, before it is queued.

Admission by predicted TTFT (``sluice serve --ttft-slo``) refuses a request whose first
token would come later than the objective. The prediction replays the engine's scheduler
(:mod:`sluice.engine.scheduler`) forward from the requests the backend has in the engine,
step by step, until the new request's prefill would complete:

- a busy engine is in a step now, so the new request joins after one step;
- every decoding sequence decodes one token a step (with speculative decoding, the mean
  tokens per decode the engine's steps emitted) and frees its slot after its last one
  (``max_tokens``: an upper bound, as EOS may come sooner);
- queued prompts take slots in FIFO order while fewer than ``max_num_seqs`` run, and share
  the step's token budget (``max_num_batched_tokens`` less the decodes) in that order;
- a step costs what :class:`StepCostModel` has measured for its prefill tokens, decodes
  and the drafted tokens those verify (speculative decoding's multi-token steps).

So it sees both ways a request waits: behind the prompts queued ahead of it (prefill
bound) and for a slot held by sequences still decoding (slot bound), which a rate of
queued prompt tokens alone cannot.

What the replay leaves out is learnt back from what happens, in two parts:

- the engine's own error (KV-cache shortage, preemption, sequences ending early, a step
  cost that drifted): each admitted request's TTFT in the engine (queued to its first
  token's step) over its raw prediction is one sample of an error ratio, and the replay
  is scaled by a running estimate of that ratio's ``quantile`` (0.99: about one request in
  a hundred is slower), from the mean and deviation of its logarithm over the last few
  dozen requests. Before any, the ratio is ``prior_ratio`` (1.5): a burst that comes
  before the first token has taught anything meets a cautious predictor;
- the lag from that step to the backend seeing the token (the event loop is busy with
  other streams), a running ``quantile`` of its seconds, added.

A refusal's ``Retry-After`` comes from :class:`RetryAfterPacer`, which stretches it while
refusals outnumber admissions. Until the engine ran enough steps to fit
its cost, nothing is predicted (``None``) and nothing is refused.

The engine thread feeds :meth:`StepCostModel.observe`; everything else runs on the event
loop. The model publishes its coefficients as one tuple, so the two need no lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from sluice.engine.engine import StepStats

__all__ = ["REFIT_EVERY_STEPS", "RetryAfterPacer", "StepCostModel", "TtftPredictor"]

# The weight of one calibration sample in the running means and variances.
_SAMPLE_WEIGHT = 0.05
# A replay gives up after this many steps (the cost model may say steps are free).
_MAX_REPLAY_STEPS = 100_000
# Predictions under this many seconds are one or two steps: their error ratio is noise.
_MIN_RATIO_PREDICTION_S = 0.05
# Bounds on the learnt error ratio: a burst of outliers cannot make it refuse everything.
_MIN_RATIO, _MAX_RATIO = 0.5, 4.0
_MAX_LAG_S = 5.0


# How many steps a step-cost fit stands for: the fit forgets a step's weight over hundreds.
REFIT_EVERY_STEPS = 8


class StepCostModel:
    """Seconds per engine step, ``a + b * prefill_tokens + c * decodes + d * drafts``,
    fitted to the steps the engine ran by exponentially weighted least squares (``drafts``:
    the speculative tokens its decodes verified; 0 without speculation).

    Each step's weight decays by ``forgetting`` per later step (0.99: the last few hundred
    steps count). Coefficients stay non-negative: when the full fit has a negative one, the
    best fit without that term is used, refitted every :data:`REFIT_EVERY_STEPS` steps (a
    fit is up to 15 small solves, 50 µs: at every step, a twentieth of a core that the
    server's event loop spends on it when the engine runs in its own process). :meth:`step_s`
    is ``None`` until ``min_steps`` steps were seen. Steps with decodes also teach, with the same forgetting, the tokens
    a decode emits (``tokens_per_decode``, 1 without speculation) and the drafts it
    verifies (``drafts_per_decode``).
    """

    __slots__ = (
        "_decode_sums",
        "_forgetting",
        "_gram",
        "_min_steps",
        "_moment",
        "_num_steps",
        "coefficients",
        "drafts_per_decode",
        "tokens_per_decode",
    )

    def __init__(self, *, forgetting: float = 0.99, min_steps: int = 8) -> None:
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if min_steps < 3:
            raise ValueError(f"min_steps must be at least 3, got {min_steps}")
        self._forgetting = forgetting
        self._min_steps = min_steps
        self._gram = np.zeros((4, 4))
        self._moment = np.zeros(4)
        self._num_steps = 0
        self._decode_sums = np.zeros(3)  # decodes, tokens they emitted, drafts, decayed
        # (a, b, c, d), replaced as a whole: read from any thread without a lock.
        self.coefficients: tuple[float, float, float, float] | None = None
        self.tokens_per_decode = 1.0
        self.drafts_per_decode = 0.0

    def observe(self, stats: StepStats) -> None:
        """Add one step (called on the engine thread)."""
        x = np.array(
            [1.0, stats.num_prefill_tokens, stats.num_decodes, stats.num_speculative_tokens]
        )
        self._gram = self._forgetting * self._gram + np.outer(x, x)
        self._moment = self._forgetting * self._moment + stats.duration_s * x
        self._num_steps += 1
        if stats.num_decodes:
            emitted = stats.tokens_per_decode * stats.num_decodes
            self._decode_sums = self._forgetting * self._decode_sums + np.array(
                [stats.num_decodes, emitted, stats.num_speculative_tokens]
            )
            decodes, tokens, drafts = self._decode_sums
            self.tokens_per_decode = max(1.0, float(tokens / decodes))
            self.drafts_per_decode = float(drafts / decodes)
        if self._num_steps >= self._min_steps and (
            self.coefficients is None or self._num_steps % REFIT_EVERY_STEPS == 0
        ):
            self.coefficients = self._fit()

    def _fit(self) -> tuple[float, float, float, float] | None:
        # The full model first, then ever fewer terms, until every coefficient is >= 0.
        for size in range(4, 0, -1):
            for terms in itertools.combinations(range(4), size):
                index = np.array(terms)
                gram = self._gram[np.ix_(index, index)] + 1e-9 * np.eye(len(terms))
                try:
                    solution = np.linalg.solve(gram, self._moment[index])
                except np.linalg.LinAlgError:
                    continue
                if (solution >= 0).all():
                    coefficients = [0.0, 0.0, 0.0, 0.0]
                    for term, value in zip(terms, solution, strict=True):
                        coefficients[term] = float(value)
                    a, b, c, d = coefficients
                    return a, b, c, d
        return self.coefficients

    def step_s(
        self, num_prefill_tokens: int, num_decodes: int, num_drafts: float | None = None
    ) -> float | None:
        """Predicted seconds of a step that runs this much (``num_drafts``: the drafts its
        decodes verify; by default what the engine's decodes have lately), or ``None``
        before a fit."""
        coefficients = self.coefficients
        if coefficients is None:
            return None
        a, b, c, d = coefficients
        if num_drafts is None:
            num_drafts = num_decodes * self.drafts_per_decode
        return a + b * num_prefill_tokens + c * num_decodes + d * num_drafts


class _Spread:
    """Exponentially weighted mean and variance of a stream of samples."""

    __slots__ = ("mean", "variance")

    def __init__(self, mean: float = 0.0) -> None:
        self.mean = mean
        self.variance = 0.0

    @property
    def deviation(self) -> float:
        return math.sqrt(self.variance)

    def add(self, sample: float) -> None:
        difference = sample - self.mean
        self.mean += _SAMPLE_WEIGHT * difference
        self.variance = (1 - _SAMPLE_WEIGHT) * (
            self.variance + _SAMPLE_WEIGHT * difference * difference
        )


@dataclass(slots=True)
class _Request:
    """What the predictor knows of one request it admitted."""

    num_prompt_tokens: int
    max_tokens: int
    queued_at: float
    raw_prediction_s: float | None
    num_generated: int = 0  # completion tokens so far: 0 while its prompt is queued


class TtftPredictor:
    """The requests one engine holds, and the time to first token a new one would see.

    The backend calls :meth:`queued` when a request goes to the engine, :meth:`generated`
    on each of its outputs and :meth:`left` when it ends in any way; keys are any hashable
    (the generation itself). Times are seconds on one monotonic clock, passed in.
    """

    __slots__ = (
        "_cost",
        "_lag",
        "_log_ratio",
        "_max_num_batched_tokens",
        "_max_num_seqs",
        "_requests",
        "_z",
        "lag_s",
        "ratio",
    )

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cost: StepCostModel,
        *,
        quantile: float = 0.99,
        prior_ratio: float = 1.5,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if not 0 < quantile < 1:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        if not _MIN_RATIO <= prior_ratio <= _MAX_RATIO:
            raise ValueError(f"prior_ratio must be in [{_MIN_RATIO}, {_MAX_RATIO}]")
        self._max_num_seqs = max_num_seqs
        self._max_num_batched_tokens = max_num_batched_tokens
        self._cost = cost
        self._requests: dict[object, _Request] = {}
        self._z = statistics.NormalDist().inv_cdf(quantile)
        # Of log(engine's TTFT / raw prediction), from a cautious prior until it has data.
        self._log_ratio = _Spread(math.log(prior_ratio))
        self._lag = _Spread()  # of seconds from the engine's first token to the backend
        self.ratio = prior_ratio  # the running ``quantile`` of engine's TTFT / raw prediction
        self.lag_s = 0.0  # the running ``quantile`` of the first token's way to the backend

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens of requests that have no output yet."""
        return sum(r.num_prompt_tokens for r in self._requests.values() if not r.num_generated)

    def predict_s(self, num_prompt_tokens: int, max_tokens: int, *, limit_s: float) -> float | None:
        """Seconds until a request queued now would have its first token in the backend
        (the replay scaled by the learnt error ratio, plus the learnt lag), or ``None``
        before the step cost is known. Beyond ``limit_s`` the replay stops early: the
        result is then only known to be over ``limit_s``."""
        raw_s = self._replay(num_prompt_tokens, max_tokens, limit_s / self.ratio)
        return None if raw_s is None else raw_s * self.ratio + self.lag_s

    def queued(
        self,
        key: object,
        num_prompt_tokens: int,
        max_tokens: int,
        now: float,
        predicted_s: float | None = None,
    ) -> None:
        """``key``'s prompt goes to the engine now; ``predicted_s`` is what
        :meth:`predict_s` said of it, if it was asked (its error teaches the ratio)."""
        raw_s = None if predicted_s is None else (predicted_s - self.lag_s) / self.ratio
        self._requests[key] = _Request(num_prompt_tokens, max_tokens, now, raw_s)

    def generated(
        self, key: object, num_completion_tokens: int, produced_at: float, now: float
    ) -> None:
        """``key`` has ``num_completion_tokens`` tokens now, the last sampled by the engine
        at ``produced_at``. The first one calibrates: the engine's TTFT (queued to
        produced) teaches the ratio, and the way from there to here (now) the lag."""
        request = self._requests.get(key)
        if request is None:
            return
        if not request.num_generated:
            self._learn(produced_at - request.queued_at, request.raw_prediction_s)
            lag = self._lag
            lag.add(max(0.0, now - produced_at))
            self.lag_s = min(_MAX_LAG_S, max(0.0, lag.mean + self._z * lag.deviation))
        request.num_generated = max(1, num_completion_tokens)

    def left(self, key: object) -> None:
        """``key`` finished, was aborted or failed (idempotent)."""
        self._requests.pop(key, None)

    def _learn(self, observed_s: float, raw_s: float | None) -> None:
        """Fold one ``observed / predicted`` sample into ``ratio``: exponentially weighted
        mean and variance of its logarithm, and the ratio at ``z`` deviations above the
        mean (the ``quantile`` if the logarithm were normal)."""
        if raw_s is None or raw_s < _MIN_RATIO_PREDICTION_S:
            return
        log_ratio = self._log_ratio
        log_ratio.add(math.log(max(observed_s, 1e-6) / raw_s))
        ratio = math.exp(log_ratio.mean + self._z * log_ratio.deviation)
        self.ratio = min(_MAX_RATIO, max(_MIN_RATIO, ratio))

    def _replay(self, num_prompt_tokens: int, max_tokens: int, limit_s: float) -> float | None:
        """Replay the scheduler until the new prompt is prefilled; its raw seconds."""
        cost = self._cost
        if cost.coefficients is None:
            return None
        ends: list[int] = []  # for each decoding sequence, the step of its last token
        queue: deque[list[int]] = deque()  # [prompt tokens left, max_tokens], FIFO
        per_step = cost.tokens_per_decode  # tokens a decode emits a step
        for request in self._requests.values():
            if request.num_generated:
                num_left = request.max_tokens - request.num_generated
                ends.append(max(1, math.ceil(num_left / per_step)))
            else:
                queue.append([request.num_prompt_tokens, request.max_tokens])
        heapq.heapify(ends)
        target = [num_prompt_tokens, max_tokens]
        # A busy engine is in a step now: the request is added after it, so it joins the
        # replay after its first step (which stands in for the step in progress).
        joins_after_step = 1 if self._requests else 0
        if not joins_after_step:
            queue.append(target)
        num_holding_slots = 0  # queued prompts at the head that have a slot
        elapsed_s = 0.0
        step = 0
        while True:
            step += 1
            num_decodes = len(ends)
            budget = self._max_num_batched_tokens - num_decodes
            num_prefill_tokens = 0
            for index, item in enumerate(queue):
                if budget <= 0:
                    break
                if index >= num_holding_slots:
                    if num_decodes + num_holding_slots >= self._max_num_seqs:
                        break
                    num_holding_slots += 1
                chunk = min(item[0], budget)
                item[0] -= chunk
                budget -= chunk
                num_prefill_tokens += chunk
            step_s = cost.step_s(num_prefill_tokens, num_decodes)
            num_alike = 1
            if not num_prefill_tokens and ends and step > joins_after_step:
                # No prompt can take a slot or a token until a decode ends: every step up
                # to that one is this step again, so they are counted at once (a replay
                # costs its changes, not its steps, however short a step is).
                num_alike = ends[0] - step + 1
                if step_s:  # up to the limit, not past it
                    steps_to_limit = math.floor((limit_s - elapsed_s) / step_s) + 1
                    num_alike = min(num_alike, max(1, steps_to_limit))
                step += num_alike - 1
            elapsed_s += 0.0 if step_s is None else num_alike * step_s
            while queue and queue[0][0] == 0:
                item = queue.popleft()
                num_holding_slots -= 1
                if item is target:
                    return elapsed_s
                heapq.heappush(ends, step + max(0, math.ceil((item[1] - 1) / per_step)))
            while ends and ends[0] <= step:
                heapq.heappop(ends)
            if step == joins_after_step:
                queue.append(target)
            if elapsed_s > limit_s or step >= _MAX_REPLAY_STEPS:
                return elapsed_s


class RetryAfterPacer:
    """``Retry-After`` for refusals, stretched while refusals outnumber admissions.

    Clients that honour ``Retry-After`` come back when told. If each is told "in 1 s"
    while the server admits ``A`` requests a second, ``N`` waiting clients come back ``N``
    times a second, and refusing them costs CPU the streams need. So the base wait (the
    predicted time over the SLO, at least a second) is multiplied by the refusals per
    admission of the last ``window_s`` seconds, when over 1: told to wait longer, the
    waiting clients return about as often as the server admits, and as they thin out the
    factor falls back to 1. Times are seconds on one monotonic clock, passed in.
    """

    __slots__ = ("_admitted", "_max_s", "_refused", "_updated", "_window_s")

    def __init__(self, *, window_s: float = 5.0, max_s: float = 60.0) -> None:
        if window_s <= 0 or max_s < 1:
            raise ValueError("window_s must be positive and max_s at least 1")
        self._window_s = window_s
        self._max_s = max_s
        self._admitted = 0.0  # exponentially decayed counts
        self._refused = 0.0
        self._updated = 0.0

    def admitted(self, now: float) -> None:
        self._decay(now)
        self._admitted += 1

    def refused(self, now: float) -> None:
        self._decay(now)
        self._refused += 1

    def retry_after_s(self, base_s: float, now: float) -> float:
        """Seconds a client refused now should wait, from ``base_s`` (at least 1)."""
        self._decay(now)
        crowd = self._refused / self._admitted if self._admitted else self._refused
        return min(self._max_s, max(1.0, base_s) * max(1.0, crowd))

    def _decay(self, now: float) -> None:
        if now > self._updated:
            kept = math.exp((self._updated - now) / self._window_s)
            self._admitted *= kept
            self._refused *= kept
            self._updated = now
