"""The acceptance rule of speculative decoding: greedy keeps the target's argmax exactly, and
the sampled rule's output is distributed as the target's own ``p`` (a chi-square test on
200,000 draws that rejects a deliberately broken rule)."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.acceptance import (
    accept,
    accept_greedy,
    accept_greedy_many,
    accept_sampled,
    accept_sampled_many,
    rejection_sample,
)
from sluice.engine.sampler import NonFiniteLogitsError, filter_logits
from sluice.engine.sampling_params import SamplingParams

NUM_DRAWS = 200_000
VOCAB = 24
# The test rejects a correct rule once in a thousand runs at random; its draws are seeded,
# so a pass is reproducible, and the broken rule's p-value is far below it (< 1e-100).
SIGNIFICANCE = 1e-3

FILTERS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=9),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.9),
]


def test_greedy_keeps_the_accepted_prefix_and_adds_the_correction() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]


def test_greedy_all_accepted_adds_the_bonus_token() -> None:
    assert accept_greedy([5, 6], [5, 6, 8]) == [5, 6, 8]
    assert accept_greedy([], [3]) == [3]


def test_greedy_verifies_in_one_pass_are_each_sequences_own() -> None:
    generator = torch.Generator().manual_seed(0)
    drafts: list[list[int]] = [[3, 1, 4], [], [5, 9]]
    rows = [torch.randn(len(draft) + 1, VOCAB, generator=generator) for draft in drafts]
    # The first sequence's first draft is the target's argmax: it is kept.
    drafts[0][0] = int(rows[0][0].argmax())
    rows[2][1, 0] = float("nan")  # the third sequence's second row is broken
    outcomes = accept_greedy_many(torch.cat(rows), drafts)
    greedy = SamplingParams(temperature=0)
    for outcome, row, draft in zip(outcomes[:2], rows, drafts, strict=False):
        assert not isinstance(outcome, Exception)
        tokens, logprobs = accept(row, draft, None, greedy)
        assert outcome[0] == tokens
        assert outcome[1] == pytest.approx(logprobs, abs=1e-6)
    assert len(outcomes[0][0]) >= 2  # type: ignore[index]
    assert isinstance(outcomes[2], NonFiniteLogitsError)
    with pytest.raises(ValueError, match="need 8 rows"):
        accept_greedy_many(torch.zeros(7, VOCAB), drafts)


def test_greedy_rejects_a_target_row_count_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="need 3 target"):
        accept_greedy([1, 2], [1, 2])


def distributions(params: SamplingParams, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random target ``p`` and draft ``q``, each filtered as ``params`` says."""
    generator = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(VOCAB, generator=generator) * 2
    draft_logits = target_logits + torch.randn(VOCAB, generator=generator) * 2
    p = torch.softmax(filter_logits(target_logits, params), dim=-1)
    q = torch.softmax(filter_logits(draft_logits, params), dim=-1)
    return p, q


def chi_square_p_value(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """The p-value of the counts of ``tokens`` against the distribution ``p``; a token that
    ``p`` gives no mass fails outright (its p-value is 0)."""
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    support = p > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = p.double()[support] * tokens.numel()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(int(support.sum()) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def draw(
    p: torch.Tensor, q: torch.Tensor | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``NUM_DRAWS`` draft tokens from ``q`` (the most likely under ``q`` when None, a
    deterministic proposal), the rule's acceptances and emitted tokens."""
    generator = torch.Generator().manual_seed(seed)
    if q is None:
        drafts = torch.full((NUM_DRAWS,), int(torch.argmax(p)))
        draft_probs = None
    else:
        drafts = torch.multinomial(q, NUM_DRAWS, replacement=True, generator=generator)
        draft_probs = q.expand(NUM_DRAWS, VOCAB)
    accepted, tokens = rejection_sample(p.expand(NUM_DRAWS, VOCAB), draft_probs, drafts, generator)
    return drafts, accepted, tokens


@pytest.mark.parametrize("params", FILTERS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_sampled_rule_output_is_distributed_as_the_target(params: SamplingParams) -> None:
    p, q = distributions(params, seed=7)
    _, accepted, tokens = draw(p, q, seed=11)
    assert 0 < float(accepted.float().mean()) < 1  # both branches of the rule ran
    assert chi_square_p_value(tokens, p) > SIGNIFICANCE


def test_deterministic_proposal_output_is_distributed_as_the_target() -> None:
    p, _ = distributions(SamplingParams(temperature=0.9, top_k=10), seed=3)
    _, accepted, tokens = draw(p, None, seed=5)
    assert 0 < float(accepted.float().mean()) < 1
    assert chi_square_p_value(tokens, p) > SIGNIFICANCE


def test_chi_square_rejects_a_rule_that_resamples_from_p_instead_of_the_residual() -> None:
    """The classic bug: a rejected token redrawn from ``p`` itself over-weights the tokens
    the draft already over-proposes. The same test and draws must reject it."""
    p, q = distributions(SamplingParams(temperature=0.8), seed=7)
    drafts, accepted, _ = draw(p, q, seed=11)
    generator = torch.Generator().manual_seed(13)
    redrawn = torch.multinomial(p, NUM_DRAWS, replacement=True, generator=generator)
    broken = torch.where(accepted, drafts, redrawn)
    assert chi_square_p_value(broken, p) < SIGNIFICANCE


def test_chi_square_rejects_a_rule_that_accepts_every_draft() -> None:
    p, q = distributions(SamplingParams(temperature=1.3, top_k=9), seed=7)
    drafts, _, _ = draw(p, q, seed=11)
    assert chi_square_p_value(drafts, p) < SIGNIFICANCE


def test_sampled_sequence_stops_at_the_first_rejection() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    # Token 1 is certain at position 1 (accepted); token 2 has p = 0 at position 2 (rejected,
    # replaced by token 0); the bonus row is never reached.
    assert accept_sampled([1, 2], p, None) == [1, 0]


def test_sampled_sequence_all_accepted_draws_the_bonus_from_the_last_row() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert accept_sampled([1], p, None) == [1, 2]


@pytest.mark.usefixtures("kernel_path")
def test_many_sequences_verified_at_once_each_keep_their_own_target() -> None:
    """20,000 sequences of two kinds (different targets, filters and drafts, alternating) in
    one call, one draft token each: every kind's first token is distributed as its own
    ``p_1`` and, where the draft was accepted, its bonus as its own ``p_2``."""
    generator = torch.Generator().manual_seed(21)
    kinds = []
    for params in (FILTERS[1], FILTERS[2]):
        target = torch.randn(2, VOCAB, generator=generator) * 2
        draft = target[0] + torch.randn(VOCAB, generator=generator) * 2
        p = torch.softmax(torch.stack([filter_logits(row, params) for row in target]), -1)
        q = torch.softmax(filter_logits(draft, params), dim=-1)
        kinds.append((target, p, q, params))
    num_seqs = 20_000
    drafted = [
        torch.multinomial(q, num_seqs // 2, replacement=True, generator=generator).tolist()
        for _, _, q, _ in kinds
    ]
    drafts, params, logits = [], [], []
    for n in range(num_seqs):
        target, _, q, kind_params = kinds[n % 2]
        drafts.append(([drafted[n % 2][n // 2]], q[None]))
        params.append(kind_params)
        logits.append(target)
    torch.manual_seed(23)
    outcomes = accept_sampled_many(torch.cat(logits), drafts, params, [None] * num_seqs)
    for kind, (_, p, _, _) in enumerate(kinds):
        runs = [outcome[0] for outcome in outcomes[kind::2]]  # type: ignore[index]
        assert chi_square_p_value(torch.tensor([run[0] for run in runs]), p[0]) > SIGNIFICANCE
        bonuses = torch.tensor([run[1] for run in runs if len(run) == 2])
        assert 0 < len(bonuses) < len(runs)
        assert chi_square_p_value(bonuses, p[1]) > SIGNIFICANCE


@pytest.mark.usefixtures("kernel_path")
def test_a_sequence_verified_with_others_gets_what_it_gets_alone() -> None:
    """Seeded sequences draw from their own generators: the batch does not change a token,
    and a sequence with a broken row fails alone."""
    generator = torch.Generator().manual_seed(5)
    sizes = [3, 1, 4, 2]
    logits = [torch.randn(size, VOCAB, generator=generator) * 2 for size in sizes]
    drafts = [
        (
            torch.randint(VOCAB, (size - 1,), generator=generator).tolist(),
            torch.softmax(torch.randn(size - 1, VOCAB, generator=generator), -1)
            if size > 1
            else None,
        )
        for size in sizes
    ]
    params = [FILTERS[i % len(FILTERS)] for i in range(len(sizes))]

    def seeded() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(len(sizes))]

    broken = [row.clone() for row in logits]
    broken[2][1, 0] = float("nan")
    together = accept_sampled_many(torch.cat(broken), drafts, params, seeded())
    alone = [
        accept_sampled_many(logits[i], [drafts[i]], [params[i]], [seeded()[i]])[0]
        for i in range(len(sizes))
    ]
    assert isinstance(together[2], NonFiniteLogitsError)
    assert [together[i] for i in (0, 1, 3)] == [alone[i] for i in (0, 1, 3)]
