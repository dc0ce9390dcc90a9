"""Simulated rollouts through the analysis: the false-alarm rate and the power it states.

Each simulation is a lane of one :class:`~sluice.rollout.analysis.Evidence` (the code the
server runs, one lane per alias). A tick gives every live rollout one canary stream and,
before it, as many stable streams as the weights imply (19 at 5 %, 3 at 25 %, 1 at 50 %);
after the canary stream the verdict is applied: roll back, promote to the next step (at 100
the rollout is done), or hold. Streams: 2 % errors, 5 % cancellations, log-normal TTFT
(median 200 ms) and inter-token latency (median 20 ms). Seeded: the same every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

from sluice.rollout.analysis import Evidence, Verdict
from sluice.rollout.config import AnalysisSettings

ERROR_RATE = 0.02
CANCEL_RATE = 0.05
# What the README states: a 3x error rate is rolled back within this many canary
# streams, a 2x TTFT within this many, each in at least 95 % of rollouts.
ERRORS_3X_WITHIN = 800
TTFT_2X_WITHIN = 60


@dataclass
class Result:
    rolled_back: np.ndarray  # bool per rollout
    promoted: np.ndarray
    canary_streams: np.ndarray  # canary streams when it ended (rolled back or promoted)


def simulate(
    num: int,
    seed: int,
    *,
    canary_error_rate: float = ERROR_RATE,
    canary_ttft_factor: float = 1.0,
    max_canary_streams: int,
    settings: AnalysisSettings | None = None,
) -> Result:
    settings = settings or AnalysisSettings()
    rng = np.random.default_rng(seed)
    evidence = Evidence(settings, num_lanes=num)
    steps = np.array(settings.steps)
    step = np.zeros(num, dtype=np.intp)
    state = np.zeros(num, dtype=np.int64)  # 0 running, 1 promoted, -1 rolled back
    ended_at = np.full(num, -1)

    def streams(lanes: np.ndarray, canary: bool) -> None:
        size = lanes.size
        failed = rng.random(size) < (canary_error_rate if canary else ERROR_RATE)
        cancelled = rng.random(size) < CANCEL_RATE
        ttft = rng.lognormal(np.log(0.2), 0.3, size) * (canary_ttft_factor if canary else 1.0)
        ttft[failed] = np.nan  # failed before its first token
        itl = rng.lognormal(np.log(0.02), 0.3, size)
        flags = np.full(size, canary)
        evidence.observe_many(lanes, flags, failed, cancelled, ttft, itl)

    for tick in range(1, max_canary_streams + 1):
        live = np.flatnonzero(state == 0)
        if not live.size:
            break
        weight = steps[step[live]]
        streams(np.repeat(live, np.rint((100 - weight) / weight).astype(np.intp)), False)
        streams(live, True)
        verdicts = evidence.verdicts(live)
        back = live[verdicts == Verdict.ROLL_BACK]
        state[back], ended_at[back] = -1, tick
        up = live[verdicts == Verdict.PROMOTE]
        step[up] += 1
        evidence.new_step(up)
        done = up[steps[step[up]] >= 100]
        state[done], ended_at[done] = 1, tick
    return Result(state == -1, state == 1, ended_at)


def test_aa_rollouts_are_rolled_back_no_more_often_than_the_false_alarm_rate() -> None:
    """1,000 canaries identical to stable, each followed for up to 1,000 of its streams
    (most are promoted to 100 % after about 600)."""
    alpha = AnalysisSettings().false_alarm_rate
    result = simulate(1000, seed=1, max_canary_streams=1000)
    # The simulation's own noise: the 99.9th percentile of rollbacks at exactly alpha.
    margin = stats.binom.ppf(0.999, 1000, alpha)
    assert result.rolled_back.sum() <= margin
    assert result.promoted.mean() > 0.8  # and an equal canary does get promoted


def test_canary_with_three_times_the_error_rate_is_rolled_back_in_95_percent() -> None:
    result = simulate(
        200, seed=2, canary_error_rate=3 * ERROR_RATE, max_canary_streams=ERRORS_3X_WITHIN
    )
    assert result.rolled_back.mean() >= 0.95
    assert result.promoted.mean() <= 0.05


def test_canary_with_twice_the_ttft_is_rolled_back_in_95_percent() -> None:
    result = simulate(200, seed=3, canary_ttft_factor=2.0, max_canary_streams=TTFT_2X_WITHIN)
    assert result.rolled_back.mean() >= 0.95
    assert result.promoted.mean() <= 0.05
