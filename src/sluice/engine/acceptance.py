"""The acceptance rule of speculative decoding: which drafted tokens the target keeps (torch).

A draft proposes tokens ``x_1 .. x_k`` after a sequence's last token; the target scores
them in one pass and so has its distribution ``p_i`` at each of the ``k + 1`` positions
(``p_1`` before ``x_1`` .. ``p_{k+1}`` after ``x_k``). The rule keeps the longest accepted
prefix and adds one more token, so a step yields between 1 and ``k + 1`` tokens:

- **greedy**: ``x_i`` is accepted while it is the target's argmax at its position; the
  first that is not is replaced by that argmax (the correction), and when all ``k`` are
  accepted the argmax after ``x_k`` is the bonus token. The output is token for token what
  the target alone would produce.
- **sampled** (Leviathan et al. 2023, Chen et al. 2023): ``x_i`` drawn from the draft's
  ``q_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; the first rejected
  is replaced by a draw from ``norm(max(0, p_i - q_i))``; all accepted, the bonus is drawn
  from ``p_{k+1}``. Each emitted token is then distributed exactly as ``p_i``, whatever
  ``q_i`` is. A deterministic proposal (prompt lookup) is the case ``q_i = onehot(x_i)``:
  accepted with probability ``p_i(x_i)``, else resampled from ``p_i`` without ``x_i``.

``p`` and ``q`` are the distributions AFTER temperature, top-k and top-p
(:func:`~sluice.engine.sampler.filter_logits`), the same for both: those are what the
target samples from without speculation.

Nothing here knows of sequences or caches: tensors and token ids in, token ids out.
:func:`accept_greedy_many` applies the greedy rule to many sequences' rows in one pass (one
argmax, one log-softmax), as the sampler does for plain greedy rows: per sequence, those few
tensor calls were most of a 64-sequence step's verify bookkeeping. On the CPU,
:func:`accept_sampled_many` runs in C when it can
(:class:`~sluice.engine.models.native_sampling.NativeSampling`: the same rule and the same
uniforms, a row's ``p`` made only when the rule reaches it); the torch code here is the
rule's reference and the path everywhere else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.engine.models.native_sampling import MAX_VERIFY_DRAFTS, load_native_sampling
from sluice.engine.sampler import (
    NonFiniteLogitsError,
    draw_tokens,
    draw_uniforms,
    filtered_probs,
    invert_cdf,
)
from sluice.engine.sampling_params import SamplingParams

__all__ = [
    "accept",
    "accept_greedy",
    "accept_greedy_many",
    "accept_sampled",
    "accept_sampled_many",
    "rejection_sample",
]


def accept_greedy(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> list[int]:
    """The tokens a greedy step emits: ``target_token_ids`` holds the target's argmax at each
    of the ``len(draft_token_ids) + 1`` positions. Raises :class:`ValueError` otherwise."""
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(
            f"{len(draft_token_ids)} draft tokens need {len(draft_token_ids) + 1} target "
            f"tokens, got {len(target_token_ids)}"
        )
    emitted: list[int] = []
    for draft, target in zip(draft_token_ids, target_token_ids, strict=False):
        emitted.append(target)
        if draft != target:
            return emitted
    emitted.append(target_token_ids[-1])
    return emitted


def accept_greedy_many(
    logits: torch.Tensor, drafts: Sequence[Sequence[int]]
) -> list[tuple[list[int], list[float]] | NonFiniteLogitsError]:
    """Greedy verifies of several sequences at once: ``logits`` stacks each one's ``[k_i +
    1, vocab]`` rows, in the order of ``drafts`` (each one's draft tokens). Per sequence, what
    :func:`accept` returns for greedy params (the emitted tokens and their logprobs), or a
    :class:`~sluice.engine.sampler.NonFiniteLogitsError` for a sequence with a broken row."""
    num_rows = sum(len(draft) + 1 for draft in drafts)
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise ValueError(f"drafts need {num_rows} rows of logits, got {tuple(logits.shape)}")
    rows = logits.float()
    # max's indices are each row's first maximum, as argmax's (Sampler.sample says why).
    top, argmax = rows.max(dim=-1)
    finite = torch.isfinite(top).tolist()
    # The emitted tokens are the target's argmax at their positions: so are their logprobs.
    chosen = torch.log_softmax(rows, dim=-1).gather(1, argmax[:, None])[:, 0].tolist()
    target_tokens = argmax.tolist()
    results: list[tuple[list[int], list[float]] | NonFiniteLogitsError] = []
    start = 0
    for draft in drafts:
        end = start + len(draft) + 1
        if not all(finite[start:end]):
            results.append(NonFiniteLogitsError())
        else:
            tokens = accept_greedy(draft, target_tokens[start:end])
            results.append((tokens, chosen[start : start + len(tokens)]))
        start = end
    return results


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule at ``n`` independent positions at once: ``target_probs`` ``[n, vocab]``,
    ``draft_probs`` ``[n, vocab]`` (None: each draft token was proposed with certainty),
    ``draft_token_ids`` ``[n]``.

    Returns ``(accepted, token_ids)``, both ``[n]``: whether each draft token is accepted,
    and the token emitted there (the draft token, or the replacement drawn from the
    residual ``norm(max(0, p - q))``). The draws come from ``generator`` (the global one
    when None).
    """
    if target_probs.dim() != 2 or draft_token_ids.shape != target_probs.shape[:1]:
        raise ValueError("target_probs must be [n, vocab] and draft_token_ids [n]")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError("draft_probs must have the shape of target_probs")
    uniforms = torch.rand((2, target_probs.shape[0]), generator=generator, dtype=torch.float64)
    return _rejection_rule(target_probs, draft_probs, draft_token_ids, uniforms)


def _rejection_rule(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rejection_sample` with its draws given: ``uniforms`` ``[2, n]`` (float64, in
    [0, 1)), row 0 for acceptance, row 1 for the residual's inverse CDF."""
    p = target_probs.float()
    rows = torch.arange(p.shape[0], device=p.device)
    p_draft = p[rows, draft_token_ids]
    if draft_probs is None:
        q = torch.zeros_like(p)
        q[rows, draft_token_ids] = 1.0
    else:
        q = draft_probs.float()
    q_draft = q[rows, draft_token_ids]
    uniforms = uniforms.to(p.device)
    # u < p/q without dividing: q(x) > 0 as the draft drew x from q.
    accepted = uniforms[0] * q_draft < p_draft
    replacement = _draw_residual(p, q, uniforms[1])
    return accepted, torch.where(accepted, draft_token_ids, replacement)


def accept_sampled(
    draft_token_ids: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens a sampled step emits: ``target_probs`` ``[k + 1, vocab]`` is ``p_1 ..
    p_{k+1}``, ``draft_probs`` ``[k, vocab]`` is ``q_1 .. q_k`` (None for a deterministic
    proposal). The residual at a position is drawn whether or not it is used: a later
    position's draw is independent of an earlier one, so the result is the sequential rule's.
    """
    num_draft = len(draft_token_ids)
    if target_probs.dim() != 2 or target_probs.shape[0] != num_draft + 1:
        raise ValueError(f"{num_draft} draft tokens need target_probs of {num_draft + 1} rows")
    emitted: list[int] = []
    if num_draft:
        drafts = torch.tensor(list(draft_token_ids), device=target_probs.device)
        accepted, tokens = rejection_sample(
            target_probs[:num_draft], draft_probs, drafts, generator
        )
        for is_accepted, token in zip(accepted.tolist(), tokens.tolist(), strict=True):
            emitted.append(token)
            if not is_accepted:
                return emitted
    bonus = draw_tokens(target_probs[num_draft : num_draft + 1], generator)[0]
    emitted.append(int(bonus))
    return emitted


def accept(
    logits: torch.Tensor,
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[float]]:
    """One sequence's verify: the target's ``[k + 1, vocab]`` logits after its last token
    and each draft token; the emitted tokens (1 to ``k + 1``) and each one's logprob under
    the target's unfiltered distribution. ``params`` filters ``p`` as the sampler would.
    Raises :class:`~sluice.engine.sampler.NonFiniteLogitsError` for a broken row."""
    if not params.greedy:
        outcome = accept_sampled_many(
            logits, [(draft_token_ids, draft_probs)], [params], [generator]
        )[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    rows = logits.float()
    if not bool(torch.isfinite(rows.max(dim=-1).values).all()):
        raise NonFiniteLogitsError()
    tokens = accept_greedy(draft_token_ids, rows.argmax(dim=-1).tolist())
    log_probs = torch.log_softmax(rows[: len(tokens)], dim=-1)
    index = torch.tensor(tokens, device=log_probs.device)[:, None]
    return tokens, log_probs.gather(1, index)[:, 0].tolist()


def accept_sampled_many(
    logits: torch.Tensor,
    drafts: Sequence[tuple[Sequence[int], torch.Tensor | None]],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[tuple[list[int], list[float]] | NonFiniteLogitsError]:
    """Sampled verifies of several sequences at once: ``logits`` stacks each one's ``[k_i +
    1, vocab]`` rows, in the order of ``drafts`` (each one's draft tokens and ``q``, None for
    a deterministic proposal), ``params`` and ``generators``. Per sequence, what
    :func:`accept` returns (the emitted tokens and their logprobs), or a
    :class:`~sluice.engine.sampler.NonFiniteLogitsError` for a sequence with a broken row.

    The rows sharing a filter are filtered in one pass; acceptance is decided at every draft
    position at once; then each sequence makes its one draw, from the residual at its first
    rejection or the bonus after its last draft, all in one inverse CDF (the residuals past
    a rejection, which the sequential rule never reaches, are not computed). Each sequence
    draws ``2 k_i + 1`` uniforms from its generator (to accept and for a residual at each
    position, one for the bonus), so a seeded sequence's tokens do not depend on what
    shares its step."""
    sizes = [len(tokens) + 1 for tokens, _ in drafts]
    if not len(drafts) == len(params) == len(generators):
        raise ValueError("need params and a generator per sequence")
    if logits.dim() != 2 or logits.shape[0] != sum(sizes):
        raise ValueError(f"drafts need {sum(sizes)} rows of logits, got {tuple(logits.shape)}")
    rows = logits.float()
    native = load_native_sampling() if rows.device.type == "cpu" else None
    if native is not None and max(sizes) <= MAX_VERIFY_DRAFTS + 1:
        uniforms = draw_uniforms(generators, [2 * size - 1 for size in sizes])
        outcomes = native.verify(rows, drafts, params, uniforms)
        return [NonFiniteLogitsError() if outcome is None else outcome for outcome in outcomes]
    finite = torch.isfinite(rows.max(dim=-1).values).tolist()
    starts = _offsets(sizes)
    good = [i for i, start in enumerate(starts) if all(finite[start : start + sizes[i]])]
    results: list[tuple[list[int], list[float]] | NonFiniteLogitsError] = [
        NonFiniteLogitsError() for _ in drafts
    ]
    if not good:
        return results
    if len(good) < len(drafts):
        rows = rows[torch.tensor([r for i in good for r in range(starts[i], starts[i] + sizes[i])])]
    p = filtered_probs(rows, [params[i] for i in good for _ in range(sizes[i])])
    vocab = p.shape[-1]
    firsts = _offsets([sizes[i] for i in good])  # each good sequence's first row of p
    uniform_starts = _offsets([2 * sizes[i] - 1 for i in good])
    uniforms = draw_uniforms([generators[i] for i in good], [2 * sizes[i] - 1 for i in good])
    # Every draft position of every sequence, packed: its row of p, token, q and uniform;
    # then one row of zeros (the "q" a bonus draw subtracts).
    rows_of: list[int] = []
    tokens_of: list[int] = []
    uniform_of: list[int] = []
    q_parts = []
    for n, i in enumerate(good):
        draft, q = drafts[i]
        rows_of.extend(range(firsts[n], firsts[n] + len(draft)))
        tokens_of.extend(draft)
        uniform_of.extend(range(uniform_starts[n], uniform_starts[n] + len(draft)))
        if draft:
            q_parts.append(_one_hot(draft, vocab) if q is None else q.float().cpu())
    draft_q = torch.cat([*q_parts, torch.zeros(1, vocab)])
    positions = torch.arange(len(tokens_of))
    # x is accepted when u * q(x) < p(x): no division, as q(x) > 0 (the draft drew x from
    # q; a deterministic proposal's q(x) is 1).
    p_of_tokens = p[
        torch.tensor(rows_of, dtype=torch.long), torch.tensor(tokens_of, dtype=torch.long)
    ]
    q_of_tokens = draft_q[positions, torch.tensor(tokens_of, dtype=torch.long)]
    accepted = (uniforms[uniform_of] * q_of_tokens.double() < p_of_tokens.cpu().double()).tolist()
    # Each sequence keeps its drafts up to its first rejection, then makes its one draw:
    # there, from norm(max(0, p - q)); with every draft accepted, the bonus from p.
    kept, draw_rows, draw_uniform, subtract = [], [], [], []
    at = 0
    for n, i in enumerate(good):
        k = sizes[i] - 1
        position = next((j for j in range(k) if not accepted[at + j]), k)
        kept.append(position)
        draw_rows.append(firsts[n] + position)
        if position < k:
            draw_uniform.append(uniform_starts[n] + k + position)
            subtract.append(at + position)
        else:
            draw_uniform.append(uniform_starts[n] + 2 * k)
            subtract.append(len(tokens_of))  # the row of zeros
        at += k
    last = _draw_residual(
        p[torch.tensor(draw_rows, dtype=torch.long)],
        draft_q[subtract].to(p.device),
        uniforms[draw_uniform].to(p.device),
    ).tolist()
    chosen = [[*drafts[i][0][: kept[n]], last[n]] for n, i in enumerate(good)]
    # Each emitted token's logprob under the target's unfiltered distribution, one gather.
    gather_rows = [firsts[n] + j for n in range(len(good)) for j in range(len(chosen[n]))]
    log_probs = torch.log_softmax(rows[gather_rows], dim=-1)
    index = torch.tensor([t for tokens in chosen for t in tokens], device=log_probs.device)
    logprobs = log_probs.gather(1, index[:, None])[:, 0].tolist()
    for n, (i, at) in enumerate(zip(good, _offsets([len(c) for c in chosen]), strict=True)):
        results[i] = (chosen[n], logprobs[at : at + len(chosen[n])])
    return results


def _draw_residual(p: torch.Tensor, q: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """A token from ``norm(max(0, p - q))`` for each row, by inverse CDF at ``uniforms``."""
    residual = (p - q).clamp_min(0.0)
    # No residual mass means p <= q everywhere, so p == q and x is always accepted; the
    # fallback to p only keeps the draw well-defined where float rounding rejected anyway.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    return invert_cdf(residual, uniforms)


def _offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive runs of ``sizes`` starts."""
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += size
    return offsets


def _one_hot(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """``q`` of a deterministic proposal: certainty on each token."""
    q = torch.zeros((len(token_ids), vocab_size))
    q[torch.arange(len(token_ids)), torch.tensor(list(token_ids))] = 1.0
    return q
