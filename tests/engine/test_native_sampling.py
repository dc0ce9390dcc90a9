"""The sampling kernel (``sampling.c``) against the torch sampler and acceptance rule it
speeds up: the same tokens at the same uniforms, the same distribution, faults per row."""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch

from sluice.engine.acceptance import accept_sampled_many
from sluice.engine.models.native_build import NativeKernelError
from sluice.engine.models.native_sampling import NativeSampling, load_native_sampling
from sluice.engine.sampler import filtered_probs, invert_cdf
from sluice.engine.sampling_params import SamplingParams

FILTERS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=20),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.5),
    SamplingParams(temperature=2.0, top_p=0.99),
]


@pytest.fixture
def native() -> NativeSampling:
    kernel = load_native_sampling()
    assert kernel is not None, "the sampling kernel did not build"
    return kernel


def test_tokens_are_the_torch_paths_at_the_same_uniforms(native: NativeSampling) -> None:
    """At 40 uniforms across each row, the kernel's token is the torch path's inverse CDF of
    softmax(filter_logits(row)): the same distribution, top-p's and top-k's support
    included; each logprob is the unfiltered log-softmax's."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(len(FILTERS) * 8, 512, generator=generator) * 3
    params = [FILTERS[i % len(FILTERS)] for i in range(rows.shape[0])]
    p = filtered_probs(rows, params)
    for u in torch.linspace(0.0, 0.999, 40, dtype=torch.float64):
        uniforms = torch.full((rows.shape[0],), float(u), dtype=torch.float64)
        tokens, logprobs = native.sample(rows, params, uniforms)
        assert tokens == invert_cdf(p, uniforms).tolist()
        expected = torch.log_softmax(rows, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5)


@pytest.mark.parametrize("params", FILTERS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_drawn_tokens_follow_the_filtered_distribution(
    native: NativeSampling, params: SamplingParams
) -> None:
    """100,000 draws of one row, chi-square against the torch filter's ``p`` at 0.1%."""
    generator = torch.Generator().manual_seed(7)
    row = torch.randn(1, 48, generator=generator) * 2
    p = filtered_probs(row, [params])[0].double()
    rows = row.expand(100_000, -1).contiguous()
    uniforms = torch.rand(rows.shape[0], generator=generator, dtype=torch.float64)
    tokens, _ = native.sample(rows, [params] * rows.shape[0], uniforms)
    counts = torch.bincount(torch.tensor(tokens), minlength=48).double()
    support = p > 0
    assert counts[~support].sum() == 0
    expected = p[support] / p[support].sum() * rows.shape[0]
    assert scipy.stats.chisquare(counts[support], expected).pvalue > 1e-3


def test_a_non_finite_row_gets_no_token_and_the_others_do(native: NativeSampling) -> None:
    rows = torch.randn(4, 64)
    rows[1, 5] = float("nan")
    rows[2, 7] = float("inf")
    rows[3] = float("-inf")
    uniforms = torch.full((4,), 0.5, dtype=torch.float64)
    tokens, _ = native.sample(rows, [FILTERS[0]] * 4, uniforms)
    assert tokens[1:] == [-1, -1, -1]
    assert 0 <= tokens[0] < 64


def test_greedy_rows_take_torchs_argmax_and_log_softmax(native: NativeSampling) -> None:
    """Ties anywhere (the first wins, as argmax), a maximum in the last, unaligned places of
    a row, NaN, +inf and all -inf rows (-1), logprobs only where asked for (NaN else)."""
    generator = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 4, (40, 4099), generator=generator).float()
    rows[0, 4098] = rows[1, 4035] = 9.0  # past the last whole run of 64
    rows[2, 17] = float("nan")
    rows[3, 100] = float("inf")
    rows[4] = float("-inf")
    rows[5, :] = -1.0  # a tie across the whole row
    with_logprobs = [row % 2 == 0 for row in range(rows.shape[0])]
    tokens, logprobs = native.greedy(rows, with_logprobs)
    expected = rows.argmax(dim=-1)
    reference = torch.log_softmax(rows, dim=-1).gather(1, expected[:, None])[:, 0]
    for row, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        if row in (2, 3, 4):
            assert token == -1
            assert math.isnan(logprob)
            continue
        assert token == int(expected[row])
        if with_logprobs[row]:
            assert logprob == pytest.approx(float(reference[row]), abs=1e-5)
        else:
            assert math.isnan(logprob)


def test_greedy_takes_a_strided_view_of_rows(native: NativeSampling) -> None:
    """Rows apart by more than their length (every other row of a matrix) are read in place;
    a logit matrix's rows of a step are such a view when some items do not sample."""
    rows = torch.randn(8, 300, generator=torch.Generator().manual_seed(2))
    tokens, _ = native.greedy(rows[::2], [False] * 4)
    assert tokens == rows[::2].argmax(dim=-1).tolist()


@pytest.mark.parametrize("uniform", [1.0, -0.1, float("nan")])
def test_a_uniform_outside_zero_one_is_refused(native: NativeSampling, uniform: float) -> None:
    with pytest.raises(NativeKernelError):
        native.sample(torch.randn(1, 8), [FILTERS[0]], torch.tensor([uniform], dtype=torch.float64))


def test_a_verify_emits_what_the_torch_rule_emits_at_the_same_uniforms(
    native: NativeSampling, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 sequences of 0-5 drafts (sampled q, or a deterministic proposal), every filter,
    each with its own seeded generator: the C verify and the torch reference emit the same
    tokens, with the same logprobs."""
    generator = torch.Generator().manual_seed(11)
    vocab = 96
    sizes = [1 + i % 6 for i in range(200)]
    params = [FILTERS[i % len(FILTERS)] for i in range(len(sizes))]
    logits = torch.randn(sum(sizes), vocab, generator=generator) * 2
    drafts: list[tuple[list[int], torch.Tensor | None]] = []
    for i, size in enumerate(sizes):
        if i % 3 == 0:  # a deterministic proposal
            drafts.append((torch.randint(vocab, (size - 1,), generator=generator).tolist(), None))
            continue
        q_logits = torch.randn(size - 1, vocab, generator=generator) * 2
        q = filtered_probs(q_logits, [params[i]] * (size - 1)) if size > 1 else None
        tokens = [] if q is None else torch.multinomial(q, 1, generator=generator)[:, 0].tolist()
        drafts.append((tokens, q))

    def seeded() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(1000 + i) for i in range(len(sizes))]

    fast = accept_sampled_many(logits, drafts, params, seeded())
    monkeypatch.setenv("SLUICE_NATIVE_KERNELS", "0")
    reference = accept_sampled_many(logits, drafts, params, seeded())
    for got, want in zip(fast, reference, strict=True):
        assert not isinstance(got, Exception)
        assert not isinstance(want, Exception)
        assert got[0] == want[0]
        assert got[1] == pytest.approx(want[1], abs=1e-5)
    assert {len(outcome[0]) for outcome in fast if not isinstance(outcome, Exception)} == {
        1,
        2,
        3,
        4,
        5,
        6,
    }


def test_a_verify_of_more_drafts_than_the_kernel_takes_is_refused(native: NativeSampling) -> None:
    k = 65
    with pytest.raises(NativeKernelError):
        native.verify(
            torch.randn(k + 1, 8),
            [([0] * k, None)],
            [FILTERS[0]],
            torch.zeros(2 * k + 1, dtype=torch.float64),
        )
