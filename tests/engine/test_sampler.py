"""The sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from sluice.engine.sampler import Sampler, filter_logits
from sluice.engine.sampling_params import SamplingParams


def test_greedy_takes_the_argmax_and_reports_its_logprob() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    tokens, logprobs = Sampler().sample(logits, [SamplingParams(temperature=0)] * 2, [1, 2])
    assert tokens == [1, 0]
    expected = torch.log_softmax(logits, dim=-1)
    assert logprobs == pytest.approx([float(expected[0, 1]), float(expected[1, 0])])


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
            tokens, _ = sampler.sample(torch.stack(rows), params, list(range(1 + batch_with)))
            out.append(tokens[0])
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
