"""The canary analysis: a sequential test of the canary's streams against the stable's.

Every finished stream of either version is judged on four **metrics**, each a yes/no
"bad stream" count (:data:`METRICS`):

- ``error``: the backend failed it, or the server aborted it;
- ``cancelled``: the client cancelled it or went away before the end;
- ``ttft_tail``: its time to first token is over the stable version's recent P99;
- ``itl_tail``: its mean inter-token latency is over the stable version's recent P99.

The tails are counts over a threshold, so a P99 comparison works with few canary
samples: under "no worse", about 1 % of the canary's streams cross the stable's P99, and a
canary at twice the latency crosses it far more often. The P99 is taken over the last
:data:`TAIL_WINDOW` stable samples, recomputed every :data:`TAIL_REFRESH` of them, and a
stream is judged against the P99 known before it ended (the stable's own streams too, so
the stable's tail rate is measured out of sample). Tails are not judged before
:data:`TAIL_MIN_SAMPLES` stable samples.

**The test.** For each metric, the stable version's bad-stream rate ``p0`` is the upper
:data:`BASELINE_QUANTILE` bound of its Jeffreys posterior (``scipy.stats.beta``; at least
:data:`MIN_BASE_RATE`), and the alternative is ``p1 = effect * p0``. After each canary
stream, the log-likelihood ratio of the canary's counts, ``binom.logpmf(x; n, p1) -
binom.logpmf(x; n, p0)`` (``scipy.stats.binom``), is compared with ``log(4 / alpha)``.
Under "the canary is no worse", the likelihood ratio is a non-negative martingale, so by
Ville's inequality it ever reaches ``1 / (alpha / 4)`` with probability at most ``alpha /
4``, however many looks: with the four metrics, a canary as good as stable is rolled
back with probability at most ``alpha`` (``false_alarm_rate``) over its whole rollout.
Taking ``p0`` at an upper bound of the stable's rate errs on the side of fewer false
alarms. The verdict after each canary stream:

- **roll back** when a metric's ratio reaches the threshold;
- **promote** (to the next step) when the canary has served ``step_streams`` streams at
  this step and every metric's ratio is at most 0 (the evidence leans to "no worse");
- **hold** otherwise.

Evidence is kept in arrays with a leading *lane* axis: each lane is one independent
rollout. The server keeps one lane per alias; the simulation tests run a thousand lanes
through the very same code in one pass.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
from scipy import stats

from sluice.rollout.config import AnalysisSettings

__all__ = [
    "BASELINE_QUANTILE",
    "BASELINE_REFRESH",
    "METRICS",
    "MIN_BASE_RATE",
    "TAIL_MIN_SAMPLES",
    "TAIL_QUANTILE",
    "TAIL_REFRESH",
    "TAIL_WINDOW",
    "Evidence",
    "Outcome",
    "Verdict",
    "baseline_rates",
    "log_likelihood_ratios",
]

METRICS: Final = ("error", "cancelled", "ttft_tail", "itl_tail")
_NUM_METRICS: Final = len(METRICS)
_NUM_COUNTED: Final = 2  # error and cancelled: every stream is judged on them
_NUM_TAILS: Final = 2  # ttft and itl
_STABLE, _CANARY = 0, 1
TAIL_QUANTILE: Final = 0.99
# Stable samples the P99 is taken over: recent enough to follow load, wide enough that
# its estimate is tight (the 99th of 500 has about 5 samples above it).
TAIL_WINDOW: Final = 500
TAIL_MIN_SAMPLES: Final = 100
TAIL_REFRESH: Final = 100
# The stable's rate is taken at this upper bound of its posterior: fewer false alarms.
BASELINE_QUANTILE: Final = 0.95
# A stable that never fails still leaves the canary room for one failure in a thousand.
MIN_BASE_RATE: Final = 0.001
_MAX_BASE_RATE: Final = 0.5
# The stable's rate bound is recomputed once its stream count grew by this many, or by a
# tenth, whichever is more (a beta quantile is costly; a few more streams barely move it).
BASELINE_REFRESH: Final = 20

_Counts = npt.NDArray[np.int64]
_Floats = npt.NDArray[np.float64]
_Lanes = npt.NDArray[np.intp]
_Flags = npt.NDArray[np.bool_]


class Verdict(enum.IntEnum):
    """The analysis's answer after a canary stream."""

    ROLL_BACK = -1
    HOLD = 0
    PROMOTE = 1


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one finished stream showed; latencies are ``None`` when it had none (a stream
    that failed before its first token, one of a single token)."""

    canary: bool
    failed: bool = False
    cancelled: bool = False
    ttft_s: float | None = None
    itl_s: float | None = None


def baseline_rates(bad: npt.ArrayLike, judged: npt.ArrayLike) -> _Floats:
    """The stable's bad-stream rates the canary is tested against: the upper
    :data:`BASELINE_QUANTILE` bound of the Jeffreys posterior ``Beta(x + 1/2, n - x + 1/2)``,
    within ``[MIN_BASE_RATE, 0.5]``."""
    x = np.asarray(bad, dtype=np.float64)
    n = np.asarray(judged, dtype=np.float64)
    upper = stats.beta.ppf(BASELINE_QUANTILE, x + 0.5, n - x + 0.5)
    return np.clip(np.asarray(upper, dtype=np.float64), MIN_BASE_RATE, _MAX_BASE_RATE)


def log_likelihood_ratios(
    bad: npt.ArrayLike, judged: npt.ArrayLike, base_rate: npt.ArrayLike, effect: float
) -> _Floats:
    """``log P(x | n, p1) - log P(x | n, p0)`` of the canary's counts, ``p1 = effect * p0``
    (kept below ``(1 + p0) / 2``); 0 where nothing was judged."""
    p0 = np.asarray(base_rate, dtype=np.float64)
    p1 = np.minimum(effect * p0, (1 + p0) / 2)
    x = np.asarray(bad)
    n = np.asarray(judged)
    ratio = stats.binom.logpmf(x, n, p1) - stats.binom.logpmf(x, n, p0)
    return np.asarray(ratio, dtype=np.float64)


def _quantiles(windows: _Floats, counts: _Counts) -> _Floats:
    """:data:`TAIL_QUANTILE` of each row's first ``count`` samples (the rest are NaN), with
    numpy's default (linear) interpolation; ``np.nanquantile`` does the same row by row."""
    ordered = np.sort(windows, axis=1)  # NaN sorts last
    position = (counts - 1) * TAIL_QUANTILE
    low = np.floor(position).astype(np.intp)
    high = np.minimum(low + 1, counts - 1)
    below = np.take_along_axis(ordered, low[:, None], axis=1)[:, 0]
    above = np.take_along_axis(ordered, high[:, None], axis=1)[:, 0]
    return np.asarray(below + (above - below) * (position - low), dtype=np.float64)


class Evidence:
    """Bad-stream counts of both versions, and the stable's tail thresholds, per lane.

    ``observe_many`` takes finished streams of any lanes; :meth:`observe` is the one-lane,
    one-stream form the server uses.
    """

    def __init__(self, settings: AnalysisSettings, num_lanes: int = 1) -> None:
        self.settings = settings
        self.num_lanes = num_lanes
        self.rollback_ratio = math.log(_NUM_METRICS / settings.false_alarm_rate)
        # [lane, version, metric]: streams judged and bad streams.
        self.judged: _Counts = np.zeros((num_lanes, 2, _NUM_METRICS), dtype=np.int64)
        self.bad: _Counts = np.zeros((num_lanes, 2, _NUM_METRICS), dtype=np.int64)
        # Canary streams since the current step began.
        self.step_streams: _Counts = np.zeros(num_lanes, dtype=np.int64)
        # [lane, tail]: the stable's threshold (NaN: not judged yet) and its sample ring.
        self.thresholds: _Floats = np.full((num_lanes, _NUM_TAILS), np.nan)
        self._window: _Floats = np.full((num_lanes, _NUM_TAILS, TAIL_WINDOW), np.nan)
        self._position = np.zeros((num_lanes, _NUM_TAILS), dtype=np.intp)
        self._count = np.zeros((num_lanes, _NUM_TAILS), dtype=np.int64)
        self._since_refresh = np.zeros((num_lanes, _NUM_TAILS), dtype=np.int64)
        # [lane, metric]: the stable's rate bounds, and its stream count when they were taken.
        self._base: _Floats = baseline_rates(self.bad[:, _STABLE], self.judged[:, _STABLE])
        self._base_streams = np.zeros(num_lanes, dtype=np.int64)

    # -- observations ---------------------------------------------------------------------

    def observe(self, outcome: Outcome) -> None:
        nan = math.nan
        self.observe_many(
            np.zeros(1, dtype=np.intp),
            np.array([outcome.canary]),
            np.array([outcome.failed]),
            np.array([outcome.cancelled]),
            np.array([nan if outcome.ttft_s is None else outcome.ttft_s]),
            np.array([nan if outcome.itl_s is None else outcome.itl_s]),
        )

    def observe_many(
        self,
        lanes: _Lanes,
        canary: _Flags,
        failed: _Flags,
        cancelled: _Flags,
        ttft_s: _Floats,
        itl_s: _Floats,
    ) -> None:
        """Streams that ended together, one per entry of ``lanes`` (a lane may repeat, up
        to :data:`TAIL_WINDOW` times); NaN latencies are not judged. All are judged
        against the tail thresholds known before the call."""
        version = canary.astype(np.intp)
        samples = np.stack((ttft_s, itl_s), axis=1)
        thresholds = self.thresholds[lanes]
        judged_tails = ~np.isnan(samples) & ~np.isnan(thresholds)
        with np.errstate(invalid="ignore"):
            bad_tails = judged_tails & (samples > thresholds)
        # Sums per (lane, version) by bincount: np.add.at does the same, many times slower.
        cell = lanes * 2 + version
        size = self.num_lanes * 2
        streams = np.bincount(cell, minlength=size)
        for metric, judged, bad in (
            (0, None, failed),
            (1, None, cancelled),
            (2, judged_tails[:, 0], bad_tails[:, 0]),
            (3, judged_tails[:, 1], bad_tails[:, 1]),
        ):
            total = streams if judged is None else np.bincount(cell, judged, size)
            self.judged[:, :, metric] += total.reshape(self.num_lanes, 2).astype(np.int64)
            self.bad[:, :, metric] += np.bincount(cell, bad, size).reshape(-1, 2).astype(np.int64)
        self.step_streams += np.bincount(lanes, canary, self.num_lanes).astype(np.int64)
        stable = ~canary
        for tail in range(_NUM_TAILS):
            keep = stable & ~np.isnan(samples[:, tail])
            if keep.any():
                self._remember(lanes[keep], tail, samples[keep, tail])

    def _remember(self, lanes: _Lanes, tail: int, samples: _Floats) -> None:
        """Add stable samples to the lanes' windows; refresh the thresholds that are due."""
        if (lanes[1:] < lanes[:-1]).any():
            order = np.argsort(lanes, kind="stable")
            lanes, samples = lanes[order], samples[order]
        starts = np.flatnonzero(np.r_[True, lanes[1:] != lanes[:-1]])
        sizes = np.diff(np.r_[starts, lanes.size])
        rank = np.arange(lanes.size) - np.repeat(starts, sizes)  # order within its lane
        self._window[lanes, tail, (self._position[lanes, tail] + rank) % TAIL_WINDOW] = samples
        each = lanes[starts]
        self._position[each, tail] = (self._position[each, tail] + sizes) % TAIL_WINDOW
        count = np.minimum(self._count[each, tail] + sizes, TAIL_WINDOW)
        self._count[each, tail] = count
        since = self._since_refresh[each, tail] + sizes
        self._since_refresh[each, tail] = since
        unknown = np.isnan(self.thresholds[each, tail])
        due = each[(count >= TAIL_MIN_SAMPLES) & (unknown | (since >= TAIL_REFRESH))]
        if due.size:
            window = self._window[due, tail, :]
            self.thresholds[due, tail] = _quantiles(window, self._count[due, tail])
            self._since_refresh[due, tail] = 0

    def new_step(self, lanes: _Lanes | None = None) -> None:
        """The canary moved to another step: its step count starts again (evidence stays)."""
        self.step_streams[slice(None) if lanes is None else lanes] = 0

    # -- the test -------------------------------------------------------------------------

    def ratios(self, lanes: _Lanes | None = None) -> _Floats:
        """The canary's log-likelihood ratio per lane and metric."""
        pick = np.arange(self.num_lanes) if lanes is None else lanes
        judged = self.judged[pick]
        bad = self.bad[pick]
        streams = judged[:, _STABLE, 0]
        last = self._base_streams[pick]
        due = pick[streams - last >= np.maximum(BASELINE_REFRESH, last // 10)]
        if due.size:
            self._refresh_base(due)
        return log_likelihood_ratios(
            bad[:, _CANARY], judged[:, _CANARY], self._base[pick], self.settings.effect
        )

    def _refresh_base(self, lanes: _Lanes) -> None:
        self._base[lanes] = baseline_rates(self.bad[lanes, _STABLE], self.judged[lanes, _STABLE])
        self._base_streams[lanes] = self.judged[lanes, _STABLE, 0]

    def verdicts(
        self, lanes: _Lanes | None = None, ratios: _Floats | None = None
    ) -> npt.NDArray[np.int64]:
        """A :class:`Verdict` value per lane (``ratios``: :meth:`ratios` of those lanes)."""
        ratios = self.ratios(lanes) if ratios is None else ratios
        steps = self.step_streams[slice(None) if lanes is None else lanes]
        back = (ratios >= self.rollback_ratio).any(axis=1)
        ready = (steps >= self.settings.step_streams) & (ratios <= 0).all(axis=1)
        codes = np.where(back, Verdict.ROLL_BACK, np.where(ready, Verdict.PROMOTE, Verdict.HOLD))
        return codes.astype(np.int64)

    def verdict(self) -> tuple[Verdict, str]:
        """Lane 0's verdict and the reason for it, in words."""
        all_ratios = self.ratios()
        code = Verdict(int(self.verdicts(ratios=all_ratios)[0]))
        ratios = all_ratios[0]
        worst = int(np.argmax(ratios))
        name = METRICS[worst]
        judged, bad = self.judged[0], self.bad[0]
        canary = f"{bad[_CANARY, worst]} of {judged[_CANARY, worst]} canary streams"
        stable = f"{bad[_STABLE, worst]} of {judged[_STABLE, worst]} stable"
        ratio = f"log-likelihood ratio {ratios[worst]:.2f}"
        limit = f"{self.rollback_ratio:.2f}"
        alpha = f"false-alarm rate {self.settings.false_alarm_rate:g}"
        steps = int(self.step_streams[0])
        if code is Verdict.ROLL_BACK:
            return code, f"{name}: {canary} vs {stable}; {ratio} >= {limit} ({alpha})"
        if code is Verdict.PROMOTE:
            return code, (
                f"{steps} canary streams at this step and no metric leans against it "
                f"(largest {ratio}, {name})"
            )
        if steps < self.settings.step_streams:
            return code, f"{steps} of {self.settings.step_streams} canary streams at this step"
        return code, f"{name} leans against the canary: {canary} vs {stable}; {ratio} < {limit}"

    # -- reports and persistence ----------------------------------------------------------

    def summary(self) -> dict[str, object]:
        """Lane 0's evidence, JSON-ready."""
        ratios = self.ratios()[0]
        base = self._base[0]
        metrics = {
            name: {
                "stable": {"bad": int(self.bad[0, 0, i]), "streams": int(self.judged[0, 0, i])},
                "canary": {"bad": int(self.bad[0, 1, i]), "streams": int(self.judged[0, 1, i])},
                "stable_rate_bound": round(float(base[i]), 6),
                "log_likelihood_ratio": round(float(ratios[i]), 4),
            }
            for i, name in enumerate(METRICS)
        }
        ttft, itl = (float(value) for value in self.thresholds[0])
        return {
            "metrics": metrics,
            "stable_ttft_p99_s": None if math.isnan(ttft) else round(ttft, 6),
            "stable_itl_p99_s": None if math.isnan(itl) else round(itl, 6),
            "canary_streams_at_step": int(self.step_streams[0]),
            "rollback_threshold": round(self.rollback_ratio, 4),
        }

    def counts(self) -> dict[str, list[list[int]] | int]:
        """Lane 0's counts, for the state file (tail windows are rebuilt after a restart)."""
        return {
            "judged": self.judged[0].tolist(),
            "bad": self.bad[0].tolist(),
            "step_streams": int(self.step_streams[0]),
        }

    def restore(
        self, judged: Sequence[Sequence[int]], bad: Sequence[Sequence[int]], step: int
    ) -> None:
        """Lane 0's counts from :meth:`counts`; raises ``ValueError`` on a wrong shape."""
        judged_array = np.asarray(judged, dtype=np.int64)
        bad_array = np.asarray(bad, dtype=np.int64)
        shape = (2, _NUM_METRICS)
        if judged_array.shape != shape or bad_array.shape != shape:
            raise ValueError(f"evidence counts must be {shape} arrays")
        if (bad_array < 0).any() or (bad_array > judged_array).any() or step < 0:
            raise ValueError("evidence counts out of range")
        self.judged[0] = judged_array
        self.bad[0] = bad_array
        self.step_streams[0] = step
        self._refresh_base(np.zeros(1, dtype=np.intp))
