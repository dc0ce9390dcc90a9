"""The TTFT predictor: a step-cost fit, a replay of the scheduler (prefill bound and slot
bound), and the error ratio it learns from what it observes."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from sluice.backends.admission import (
    REFIT_EVERY_STEPS,
    RetryAfterPacer,
    StepCostModel,
    TtftPredictor,
)
from sluice.engine.engine import StepStats


def fitted(a: float, b: float, c: float, d: float = 0.0) -> StepCostModel:
    cost = StepCostModel()
    cost.coefficients = (a, b, c, d)
    return cost


def test_step_cost_is_unknown_until_enough_steps_then_fits_a_linear_cost() -> None:
    cost = StepCostModel(min_steps=8)
    rng = random.Random(1)
    for count in range(40):
        assert (cost.step_s(1, 1) is None) == (count < 8)
        prefill, decodes = rng.randrange(0, 400), rng.randrange(0, 64)
        cost.observe(StepStats(prefill, decodes, 0.01 + 0.0002 * prefill + 0.001 * decodes))
    assert cost.coefficients == pytest.approx((0.01, 0.0002, 0.001, 0.0), rel=1e-3)
    assert cost.step_s(100, 10) == pytest.approx(0.01 + 0.02 + 0.01, rel=1e-3)


def test_step_cost_drops_a_term_rather_than_go_negative() -> None:
    """Decode-only steps that get cheaper with more decodes (noise, say) fit no negative
    per-decode cost."""
    cost = StepCostModel(min_steps=3)
    for decodes in range(1, 30):
        cost.observe(StepStats(0, decodes, 0.05 - 0.0005 * decodes))
    assert cost.coefficients is not None
    assert min(cost.coefficients) >= 0
    step_s = cost.step_s(0, 10)
    assert step_s is not None
    assert 0.03 < step_s < 0.05  # the mean decode step


def test_step_cost_is_refitted_every_few_steps_not_at_each() -> None:
    """The first fit comes at ``min_steps``; then the fit stands for REFIT_EVERY_STEPS steps
    (a fit is a few small solves, at every step a share of the event loop's core)."""
    cost = StepCostModel(min_steps=3)
    for _ in range(REFIT_EVERY_STEPS):
        cost.observe(StepStats(0, 8, 0.02))
    first = cost.step_s(0, 8)
    assert first == pytest.approx(0.02)
    for _ in range(REFIT_EVERY_STEPS - 1):
        cost.observe(StepStats(0, 8, 0.08))
        assert cost.step_s(0, 8) == first
    cost.observe(StepStats(0, 8, 0.08))
    refitted = cost.step_s(0, 8)
    assert refitted is not None
    assert refitted > 0.04


def test_step_cost_forgets_old_steps() -> None:
    cost = StepCostModel(forgetting=0.9, min_steps=3)
    for _ in range(50):
        cost.observe(StepStats(0, 8, 0.02))
    for _ in range(100):
        cost.observe(StepStats(0, 8, 0.08))  # the machine got busy
    assert cost.step_s(0, 8) == pytest.approx(0.08, rel=0.01)


def test_nothing_is_predicted_before_the_step_cost_is_known() -> None:
    predictor = TtftPredictor(4, 64, StepCostModel())
    assert predictor.predict_s(10, 10, limit_s=1.0) is None


def test_prefill_bound_prediction_counts_the_prompts_queued_ahead() -> None:
    """A budget of 100 tokens a step: three 100-token prompts ahead (each ends with its
    first token, so none takes budget to decode), then ours."""
    predictor = TtftPredictor(64, 100, fitted(0.01, 0.001, 0.0), prior_ratio=1.0)
    assert predictor.predict_s(100, 8, limit_s=10.0) == pytest.approx(0.11)
    for key in range(3):
        predictor.queued(key, 100, 1, now=0.0)
    assert predictor.num_queued_tokens == 300
    assert predictor.predict_s(100, 8, limit_s=10.0) == pytest.approx(4 * 0.11)

    # A busy engine is in a step now: ours joins after it, even with budget left over.
    predictor = TtftPredictor(64, 100, fitted(0.01, 0.001, 0.0), prior_ratio=1.0)
    predictor.queued("ahead", 50, 8, now=0.0)
    assert predictor.predict_s(50, 8, limit_s=10.0) == pytest.approx(0.06 + 0.06)


def test_slot_bound_prediction_waits_for_the_first_sequence_to_end() -> None:
    """Two slots, both decoding: 5 and 9 tokens left. Ours is prefilled the step after the
    first ends, and the decodes of each step cost too."""
    predictor = TtftPredictor(2, 100, fitted(0.01, 0.0, 0.005), prior_ratio=1.0)
    predictor.queued("a", 10, 6, now=0.0)
    predictor.generated("a", 1, produced_at=0.0, now=0.0)  # 5 left
    predictor.queued("b", 10, 10, now=0.0)
    predictor.generated("b", 1, produced_at=0.0, now=0.0)  # 9 left
    two_decoding, one_decoding = 0.01 + 2 * 0.005, 0.01 + 1 * 0.005
    assert predictor.predict_s(10, 8, limit_s=10.0) == pytest.approx(
        5 * two_decoding + one_decoding
    )
    predictor.generated("a", 4, produced_at=0.0, now=0.0)  # 2 left now
    assert predictor.predict_s(10, 8, limit_s=10.0) == pytest.approx(
        2 * two_decoding + one_decoding
    )
    predictor.left("a")
    predictor.left("a")  # idempotent
    # A slot is free: the step in progress, then ours.
    assert predictor.predict_s(10, 8, limit_s=10.0) == pytest.approx(2 * one_decoding)


def test_step_cost_learns_what_speculative_decodes_verify_and_emit() -> None:
    """Steps whose decodes each verify 3 drafts and emit 2 tokens: the fit separates the
    drafts' cost, and a decode counts as 2 tokens a step."""
    cost = StepCostModel(min_steps=3)
    rng = random.Random(2)
    for _ in range(60):
        decodes = rng.randrange(1, 32)
        drafts = 3 * decodes if rng.random() < 0.5 else 0
        emitted = 2 * decodes if drafts else decodes
        duration_s = 0.01 + 0.001 * decodes + 0.0004 * drafts
        cost.observe(StepStats(0, decodes, duration_s, drafts, emitted))
    assert cost.coefficients == pytest.approx((0.01, 0.0, 0.001, 0.0004), rel=1e-3, abs=1e-9)
    assert 1.3 < cost.tokens_per_decode < 1.7  # half the steps speculated
    assert cost.step_s(0, 10, num_drafts=30) == pytest.approx(0.01 + 0.01 + 0.012, rel=1e-3)


def test_slot_bound_prediction_counts_multi_token_decode_steps() -> None:
    """One slot, 8 tokens left at 2 tokens a step: it ends after 4 steps, not 8."""
    cost = fitted(0.01, 0.0, 0.0)
    cost.tokens_per_decode = 2.0
    predictor = TtftPredictor(1, 100, cost, prior_ratio=1.0)
    predictor.queued("a", 10, 9, now=0.0)
    predictor.generated("a", 1, produced_at=0.0, now=0.0)
    assert predictor.predict_s(10, 8, limit_s=10.0) == pytest.approx(5 * 0.01)


def test_queued_prompts_become_decodes_that_hold_their_slot() -> None:
    """One slot: the prompt ahead is prefilled in step 1, decodes 3 more tokens (steps 2-4)
    and frees the slot; ours is prefilled in step 5."""
    predictor = TtftPredictor(1, 100, fitted(0.1, 0.0, 0.0), prior_ratio=1.0)
    predictor.queued("ahead", 10, 4, now=0.0)
    assert predictor.predict_s(10, 4, limit_s=10.0) == pytest.approx(0.5)


def test_a_replay_stops_at_its_limit() -> None:
    predictor = TtftPredictor(1, 100, fitted(0.1, 0.0, 0.0), prior_ratio=1.0)
    predictor.queued("long", 10, 10_000, now=0.0)
    predictor.generated("long", 1, produced_at=0.0, now=0.0)
    predicted = predictor.predict_s(10, 4, limit_s=1.0)
    assert predicted is not None
    assert 1.0 < predicted < 1.2  # over the limit, without replaying 10,000 steps


def step_by_step_s(
    cost: tuple[float, float, float],
    max_num_seqs: int,
    budget: int,
    decoding: list[int],
    queued: list[tuple[int, int]],
    target: tuple[int, int],
) -> float:
    """The scheduler as the predictor's docstring tells it, one step at a time: each
    running sequence decodes a token a step until none is left (``decoding``: tokens
    left), queued prompts take free slots in FIFO order and share the step's budget, a
    prefilled prompt runs its first token and then decodes the rest; a busy engine adds
    the new prompt after the step in progress. Seconds until the target is prefilled."""
    a, b, c = cost
    running = list(decoding)
    waiting = [[prompt, max_tokens] for prompt, max_tokens in queued]
    ours = [*target]
    busy = bool(running or waiting)
    if not busy:
        waiting.append(ours)
    with_slot, elapsed_s, step = 0, 0.0, 0
    while True:
        step += 1
        left, num_tokens = budget - len(running), 0
        for index, item in enumerate(waiting):
            if left <= 0 or (index >= with_slot and len(running) + with_slot >= max_num_seqs):
                break
            with_slot = max(with_slot, index + 1)
            taken = min(item[0], left)
            item[0] -= taken
            left -= taken
            num_tokens += taken
        elapsed_s += a + b * num_tokens + c * len(running)
        running = [tokens - 1 for tokens in running if tokens > 1]
        while waiting and waiting[0][0] == 0:
            item = waiting.pop(0)
            with_slot -= 1
            if item is ours:
                return elapsed_s
            if item[1] > 1:
                running.append(item[1] - 1)
        if busy and step == 1:
            waiting.append(ours)


def test_the_replay_skips_alike_steps_and_agrees_with_the_scheduler_step_by_step() -> None:
    """Random engine states: the replay (which counts the steps that wait for a decode to
    end at once) predicts what a step-by-step walk of the scheduler adds up to."""
    rng = random.Random(11)
    for _ in range(400):
        cost = (rng.uniform(0.001, 0.02), rng.uniform(0, 1e-4), rng.uniform(0, 0.002))
        max_num_seqs, budget = rng.randint(1, 8), rng.randint(8, 128)
        predictor = TtftPredictor(max_num_seqs, budget, fitted(*cost), prior_ratio=1.0)
        decoding: list[int] = []
        queued: list[tuple[int, int]] = []
        for key in range(rng.randint(0, 12)):
            prompt, max_tokens = rng.randint(1, 300), rng.randint(1, 300)
            predictor.queued(key, prompt, max_tokens, now=0.0)
            if rng.random() < 0.5 and len(decoding) < max_num_seqs:
                generated = rng.randint(1, max_tokens)
                predictor.generated(key, generated, produced_at=0.0, now=0.0)
                decoding.append(max(1, max_tokens - generated))
            else:
                queued.append((prompt, max_tokens))
        target = (rng.randint(1, 300), rng.randint(1, 300))
        expected = step_by_step_s(cost, max_num_seqs, budget, decoding, queued, target)
        predicted = predictor.predict_s(*target, limit_s=1e9)
        assert predicted == pytest.approx(expected, rel=1e-9)


def serve(
    predictor: TtftPredictor, keys: range, produced_at: Callable[[], float], lag_s: float = 0.0
) -> None:
    """Admit one request per key as predicted, its first token produced ``produced_at()``
    seconds after it was queued and seen ``lag_s`` later, then end it."""
    for key in keys:
        predicted = predictor.predict_s(10, 4, limit_s=100.0)
        assert predicted is not None
        predictor.queued(key, 10, 4, now=0.0, predicted_s=predicted)
        produced = produced_at()
        predictor.generated(key, 1, produced_at=produced, now=produced + lag_s)
        predictor.left(key)


def test_error_ratio_learns_a_high_quantile_of_observed_over_predicted() -> None:
    """Requests that take twice their prediction nineteen times in twenty (and the rest
    on time) raise the ratio above 2, to cover the 99th percentile with a margin; requests
    that come on time bring it back to 1 within a couple of hundred."""
    predictor = TtftPredictor(64, 100, fitted(0.1, 0.0, 0.0), prior_ratio=1.0)
    rng = random.Random(3)
    serve(predictor, range(2000), lambda: 0.1 * (2.0 if rng.random() < 0.95 else 1.0))
    assert 2.0 < predictor.ratio < 3.5
    serve(predictor, range(2000, 2200), lambda: 0.1)
    assert predictor.ratio == pytest.approx(1.0, abs=0.05)


def test_predictions_of_a_step_or_two_do_not_teach_the_ratio() -> None:
    predictor = TtftPredictor(64, 100, fitted(0.001, 0.0, 0.0))
    for key in range(100):
        predictor.queued(key, 10, 4, now=0.0, predicted_s=0.001)
        predictor.generated(key, 1, produced_at=0.5, now=0.5)  # a stall, not a model error
    assert predictor.ratio == 1.5  # still the prior


def test_until_it_has_learnt_the_predictor_is_cautious_then_the_prior_fades() -> None:
    predictor = TtftPredictor(64, 100, fitted(0.1, 0.0, 0.0))
    assert predictor.predict_s(10, 4, limit_s=100.0) == pytest.approx(0.15)  # 1.5 x 0.1 s
    serve(predictor, range(100), lambda: 0.1)  # requests that come exactly on time
    assert predictor.ratio == pytest.approx(1.0, abs=0.1)


def test_the_way_from_the_engine_to_the_backend_is_learnt_as_added_seconds() -> None:
    """Tokens the engine produced on time but the backend saw 0.2 s later add 0.2 s to
    every prediction (not twice as much to a prediction twice as long); the engine's
    ratio stays 1."""
    predictor = TtftPredictor(64, 100, fitted(0.1, 0.0, 0.0), prior_ratio=1.0)
    serve(predictor, range(200), lambda: 0.1, lag_s=0.2)
    assert predictor.ratio == pytest.approx(1.0)
    assert predictor.lag_s == pytest.approx(0.2, abs=0.01)
    assert predictor.predict_s(10, 4, limit_s=100.0) == pytest.approx(0.1 + predictor.lag_s)
    predictor.queued("ahead", 100, 1, now=0.0)
    assert predictor.predict_s(10, 4, limit_s=100.0) == pytest.approx(0.2 + predictor.lag_s)


def test_retry_after_is_the_base_until_refusals_outnumber_admissions() -> None:
    pacer = RetryAfterPacer(window_s=5.0)
    assert pacer.retry_after_s(0.2, now=0.0) == 1.0  # at least a second
    assert pacer.retry_after_s(3.0, now=0.0) == 3.0
    for tick in range(10):
        pacer.admitted(now=tick * 0.1)
        pacer.refused(now=tick * 0.1)
    assert pacer.retry_after_s(1.0, now=1.0) == pytest.approx(1.0)  # one refusal per admission
    for tick in range(40):
        pacer.refused(now=1.0 + tick * 0.01)  # a crowd: 50 refusals for 10 admissions
    assert pacer.retry_after_s(1.0, now=1.4) == pytest.approx(5.0, rel=0.15)  # decayed
    assert pacer.retry_after_s(1e6, now=1.4) == 60.0  # bounded


def test_retry_after_falls_back_as_the_crowd_thins() -> None:
    pacer = RetryAfterPacer(window_s=5.0)
    for tick in range(100):
        pacer.refused(now=tick * 0.01)
    pacer.admitted(now=1.0)
    assert pacer.retry_after_s(1.0, now=1.0) > 50
    for tick in range(1, 201):  # then admissions only, 20 s of them
        pacer.admitted(now=1.0 + tick * 0.1)
    assert pacer.retry_after_s(1.0, now=21.0) == 1.0
