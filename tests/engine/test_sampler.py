"""The sampler: greedy, temperature, top-k, top-p, per-request seeds; no NaN for any value
the parameters accept, and a row that cannot be sampled fails alone."""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch

from sluice.engine.sampler import (
    NonFiniteLogitsError,
    Sampled,
    Sampler,
    draw_tokens,
    filter_logits,
    filtered_probs,
    invert_cdf,
)
from sluice.engine.sampling_params import GREEDY_TEMPERATURE, MAX_TEMPERATURE, SamplingParams

# Every test runs on the C sampling kernel and on the torch path (conftest.kernel_path).
pytestmark = pytest.mark.usefixtures("kernel_path")

# The temperatures of the probe's attack, and values about the greedy threshold.
TINY_TEMPERATURES = [5e-324, 1e-300, 1e-40, 1e-38, 1e-30, 1e-10, GREEDY_TEMPERATURE / 2]


def tokens(results: list[Sampled | Exception]) -> list[int]:
    assert all(isinstance(r, Sampled) for r in results), results
    return [r.token_id for r in results if isinstance(r, Sampled)]


def test_greedy_takes_the_argmax_and_reports_its_logprob() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0, logprobs=True)] * 2
    results = Sampler().sample(logits, params, [1, 2])
    assert tokens(results) == [1, 0]
    expected = torch.log_softmax(logits, dim=-1)
    logprobs = [r.logprob for r in results if isinstance(r, Sampled)]
    assert logprobs == pytest.approx([float(expected[0, 1]), float(expected[1, 0])])


def test_greedy_ties_take_the_first_maximum_as_argmax_does() -> None:
    """Every tie of a wide batch, wherever it sits, resolves to the first index."""
    torch.manual_seed(0)
    logits = torch.randn(64, 4096)
    for row in range(64):
        first = (row * 61) % 4000
        logits[row, first] = logits[row, first + 1 + row] = 10.0
    results = Sampler().sample(logits, [SamplingParams(temperature=0)] * 64, list(range(64)))
    assert tokens(results) == [(row * 61) % 4000 for row in range(64)]
    assert tokens(results) == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_largest() -> None:
    filtered = filter_logits(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(top_k=2))
    assert torch.isinf(filtered[[0, 3]]).all()
    assert torch.isfinite(filtered[[1, 2]]).all()


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    filtered = filter_logits(probs.log(), SamplingParams(top_p=0.7))
    assert torch.isfinite(filtered[[0, 1]]).all()  # 0.5 < 0.7, then 0.8 >= 0.7
    assert torch.isinf(filtered[[2, 3]]).all()
    only_first = filter_logits(probs.log(), SamplingParams(top_p=0.1))
    assert torch.isfinite(only_first).tolist() == [True, False, False, False]


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch() -> None:
    vocab = 50
    logits = torch.randn(20, vocab, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_with: int) -> list[int]:
        sampler = Sampler()
        out = []
        for step in range(20):
            rows = [logits[step]] + [torch.randn(vocab) for _ in range(batch_with)]
            params = [seeded] + [SamplingParams(temperature=1.0)] * batch_with
            results = sampler.sample(torch.stack(rows), params, list(range(1 + batch_with)))
            out.append(tokens(results)[0])
        return out

    assert draws(0) == draws(5) == draws(2)


def test_temperature_sharpens_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = torch.softmax(filter_logits(logits, SamplingParams(temperature=0.1)), dim=-1)
    hot = torch.softmax(filter_logits(logits, SamplingParams(temperature=10.0)), dim=-1)
    assert cold[0] > 0.99
    assert math.isclose(float(hot.sum()), 1.0, rel_tol=1e-6)
    assert float(hot.max() - hot.min()) < 0.1


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="one params per row"):
        Sampler().sample(torch.zeros(2, 3), [SamplingParams()], [1])


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_temperature_below_the_threshold_is_greedy(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).greedy
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 30
    params = [SamplingParams(temperature=temperature, seed=3)] * 8
    assert tokens(Sampler().sample(logits, params, list(range(8)))) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "temperature", [*TINY_TEMPERATURES, GREEDY_TEMPERATURE, 1e-4, 0.5, 2.0, MAX_TEMPERATURE]
)
@pytest.mark.parametrize("scale", [1.0, 1e4, 1e30])
def test_filtered_logits_are_never_nan_for_any_accepted_temperature(
    temperature: float, scale: float
) -> None:
    """Large logits (1e30) over a tiny temperature once overflowed to inf, then NaN."""
    logits = torch.randn(200, generator=torch.Generator().manual_seed(2)) * scale
    for top_k, top_p in [(0, 1.0), (1, 1.0), (5, 0.5), (0, 1e-300), (0, 5e-324), (300, 0.999)]:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        filtered = filter_logits(logits, params)
        assert not torch.isnan(filtered).any()
        assert float(filtered.max()) == 0.0  # the most likely token is always kept
        assert int(filtered.argmax()) == int(logits.argmax())


@pytest.mark.parametrize("temperature", [GREEDY_TEMPERATURE, 1e-4])
def test_sampling_just_above_the_threshold_draws_the_clear_favourite(temperature: float) -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, -3.0]] * 16)
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(16)]
    assert tokens(Sampler().sample(logits, params, list(range(16)))) == [1] * 16


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-9])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    """A top_p below float32's smallest value compares as 0: it once dropped every token."""
    logits = torch.tensor([[0.0, 2.0, 1.0]] * 4)
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=i) for i in range(4)]
    assert tokens(Sampler().sample(logits, params, list(range(4)))) == [1] * 4


def test_the_largest_temperature_draws_from_the_whole_vocabulary() -> None:
    logits = torch.tensor([[10.0, 0.0, -10.0]] * 300)
    params = [SamplingParams(temperature=MAX_TEMPERATURE, seed=i) for i in range(300)]
    assert set(tokens(Sampler().sample(logits, params, list(range(300))))) == {0, 1, 2}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_a_row_with_non_finite_logits_fails_alone(bad: float | str) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 1.0, 2.0], [5.0, 0.0, 0.0]])
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 0] = bad
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=1)] * 3
        first, middle, last = Sampler().sample(logits, params, [1, 2, 3])
        assert isinstance(middle, NonFiniteLogitsError)
        assert str(middle) == "the model produced non-finite logits for this request"
        assert tokens([first, last]) == [1, 0]


def test_negative_infinity_for_some_tokens_is_no_fault() -> None:
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf")]])
    for temperature in (0.0, 1.0, 1e-300):
        params = [SamplingParams(temperature=temperature, seed=1)]
        assert tokens(Sampler().sample(logits, params, [1])) == [1]


def test_drawn_tokens_follow_each_rows_distribution() -> None:
    """200,000 draws of two unnormalised rows with zeros: never a token without mass, and a
    chi-square test against each row at 0.1%."""
    generator = torch.Generator().manual_seed(7)
    probs = torch.tensor([[0.0, 3.0, 0.5, 0.0, 1.5, 5.0], [2.0, 0.0, 0.0, 1.0, 0.0, 1.0]])
    counts = torch.zeros_like(probs)
    for _ in range(200):
        tokens = draw_tokens(probs.repeat(500, 1), generator).view(500, 2)
        for row in range(2):
            counts[row] += torch.bincount(tokens[:, row], minlength=6)
    assert not counts[probs == 0].any()
    for row in range(2):
        kept = probs[row] > 0
        expected = probs[row][kept] / probs[row].sum() * counts[row].sum()
        assert scipy.stats.chisquare(counts[row][kept], expected).pvalue > 1e-3


def test_a_uniform_that_rounds_up_to_the_mass_draws_the_last_token_with_mass() -> None:
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]])
    assert invert_cdf(probs, torch.tensor([1.0, 1.0], dtype=torch.float64)).tolist() == [1, 2]
    assert invert_cdf(probs, torch.tensor([0.0, 0.5], dtype=torch.float64)).tolist() == [0, 2]


MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=0.9, top_p=0.6),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
]


def test_filtered_probs_of_a_mixed_batch_are_each_rows_own() -> None:
    rows = torch.randn(len(MIXED), 40, generator=torch.Generator().manual_seed(3)) * 3
    expected = torch.stack(
        [
            torch.softmax(filter_logits(row, params), dim=-1)
            for row, params in zip(rows, MIXED, strict=True)
        ]
    )
    torch.testing.assert_close(filtered_probs(rows, MIXED), expected)


def test_a_mixed_batch_draws_each_row_within_its_own_filter() -> None:
    """Every row of a batch of different filters lands where its own filter keeps mass,
    and a top-k of 1 or a tiny top-p always draws the argmax."""
    sampler = Sampler()
    params = [*MIXED, SamplingParams(temperature=1.5, top_k=1), SamplingParams(top_p=1e-9)]
    generator = torch.Generator().manual_seed(4)
    for _ in range(50):
        rows = torch.randn(len(params), 40, generator=generator) * 3
        results = tokens(sampler.sample(rows, params, list(range(len(params)))))
        for row, (token, row_params) in enumerate(zip(results, params, strict=True)):
            assert filter_logits(rows[row], row_params)[token] > float("-inf")
        assert results[-2:] == rows[-2:].argmax(dim=-1).tolist()
