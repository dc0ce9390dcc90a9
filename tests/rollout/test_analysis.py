"""The analysis on hand-made evidence: rates, ratios, thresholds and verdicts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from sluice.rollout.analysis import (
    MIN_BASE_RATE,
    TAIL_MIN_SAMPLES,
    Evidence,
    Outcome,
    Verdict,
    baseline_rates,
    log_likelihood_ratios,
)
from sluice.rollout.config import AnalysisSettings


def test_baseline_rate_is_an_upper_bound_of_the_stable_rate() -> None:
    (rate,) = baseline_rates([20], [1000])
    assert 0.02 < rate < 0.03
    assert baseline_rates([0], [1_000_000])[0] == MIN_BASE_RATE


def test_log_likelihood_ratio_matches_binomial_pmfs() -> None:
    (ratio,) = log_likelihood_ratios([5], [100], [0.02], 2.0)
    expected = math.log(stats.binom.pmf(5, 100, 0.04) / stats.binom.pmf(5, 100, 0.02))
    assert ratio == pytest.approx(expected)
    assert log_likelihood_ratios([0], [0], [0.02], 2.0)[0] == 0


def stable_then_canary(
    evidence: Evidence, *, stable: int, canary: Outcome, num_canary: int
) -> None:
    for n in range(stable):
        evidence.observe(Outcome(canary=False, failed=n % 50 == 0, ttft_s=0.1 + n % 100 / 1000))
    for _ in range(num_canary):
        evidence.observe(canary)


def test_failing_canary_is_rolled_back_with_a_reason_naming_the_metric() -> None:
    evidence = Evidence(AnalysisSettings())
    stable_then_canary(evidence, stable=1000, canary=Outcome(True, failed=True), num_canary=10)
    verdict, reason = evidence.verdict()
    assert verdict is Verdict.ROLL_BACK
    assert reason.startswith("error: 10 of 10 canary streams vs 20 of 1000 stable")
    assert "false-alarm rate 0.01" in reason


def test_good_canary_is_held_until_its_step_streams_then_promoted() -> None:
    evidence = Evidence(AnalysisSettings(step_streams=50))
    good = Outcome(True, ttft_s=0.1, itl_s=None)
    stable_then_canary(evidence, stable=1000, canary=good, num_canary=49)
    assert evidence.verdict() == (Verdict.HOLD, "49 of 50 canary streams at this step")
    evidence.observe(good)
    verdict, reason = evidence.verdict()
    assert verdict is Verdict.PROMOTE
    assert reason.startswith("50 canary streams at this step")
    evidence.new_step()
    assert evidence.verdict()[0] is Verdict.HOLD  # the next step counts again


def test_tails_are_judged_against_the_stable_p99_only_once_it_is_known() -> None:
    evidence = Evidence(AnalysisSettings())
    slow = Outcome(True, ttft_s=5.0)
    evidence.observe(slow)
    assert evidence.judged[0, 1, 2] == 0  # no stable P99 yet: not judged
    stable_then_canary(evidence, stable=TAIL_MIN_SAMPLES, canary=slow, num_canary=1)
    assert evidence.thresholds[0, 0] == pytest.approx(
        np.quantile(0.1 + np.arange(100) / 1000, 0.99)
    )
    assert (evidence.judged[0, 1, 2], evidence.bad[0, 1, 2]) == (1, 1)


def test_many_lanes_with_repeats_count_like_one_lane_at_a_time() -> None:
    settings = AnalysisSettings()
    rng = np.random.default_rng(3)
    lanes = rng.integers(0, 4, 600).astype(np.intp)
    canary = rng.random(600) < 0.3
    failed = rng.random(600) < 0.1
    cancelled = rng.random(600) < 0.1
    ttft = rng.random(600)
    itl = np.where(rng.random(600) < 0.2, np.nan, rng.random(600))
    together = Evidence(settings, num_lanes=4)
    for start in range(0, 600, 100):  # batches that end together
        part = slice(start, start + 100)
        together.observe_many(
            lanes[part], canary[part], failed[part], cancelled[part], ttft[part], itl[part]
        )
    for lane in range(4):
        alone = Evidence(settings)
        for start in range(0, 600, 100):
            for i in range(start, start + 100):
                if lanes[i] == lane:
                    one = (
                        np.zeros(1, np.intp),
                        canary[i : i + 1],
                        failed[i : i + 1],
                        cancelled[i : i + 1],
                    )
                    alone.observe_many(*one, ttft[i : i + 1], itl[i : i + 1])
        # Streams of one batch are judged against the thresholds before it: compare only
        # the counts that every order agrees on.
        assert (together.judged[lane, :, :2] == alone.judged[0, :, :2]).all()
        assert (together.bad[lane, :, :2] == alone.bad[0, :, :2]).all()
        assert together.step_streams[lane] == alone.step_streams[0]


def test_counts_survive_a_round_trip_and_bad_shapes_are_refused() -> None:
    evidence = Evidence(AnalysisSettings())
    stable_then_canary(evidence, stable=300, canary=Outcome(True, cancelled=True), num_canary=3)
    counts = evidence.counts()
    copy = Evidence(AnalysisSettings())
    copy.restore(counts["judged"], counts["bad"], counts["step_streams"])  # type: ignore[arg-type]
    assert (copy.judged == evidence.judged).all()
    assert (copy.bad == evidence.bad).all()
    assert copy.ratios() == pytest.approx(evidence.ratios())
    with pytest.raises(ValueError, match="arrays"):
        copy.restore([[1]], [[0]], 0)
    with pytest.raises(ValueError, match="out of range"):
        copy.restore([[1] * 4] * 2, [[2] * 4] * 2, 0)


def test_summary_is_json_ready() -> None:
    import json

    evidence = Evidence(AnalysisSettings())
    stable_then_canary(
        evidence, stable=200, canary=Outcome(True, ttft_s=0.1, itl_s=0.01), num_canary=2
    )
    summary = evidence.summary()
    json.dumps(summary)
    assert summary["canary_streams_at_step"] == 2
    assert summary["stable_ttft_p99_s"] is not None
    assert summary["stable_itl_p99_s"] is None  # no stable stream had an ITL
