"""Speculative decoding for one engine: each step's ``k``, the drafts, their verify, the counts.

The engine asks :meth:`Speculator.plan` which decoding sequences speculate how far (the
step's ``k``, from :class:`~sluice.engine.speculative.AdaptiveK` or fixed, cut to each
request's ``max_tokens`` and the context limit), passes that to the scheduler as lookahead,
asks :meth:`Speculator.propose` for the drafts of the items that got lookahead slots, runs
the target's verify, and hands each verified row to :meth:`Speculator.verify`, which applies
the acceptance rule (:func:`~sluice.engine.acceptance.accept`) and counts.
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_

import torch

from sluice.engine.acceptance import accept, accept_greedy_many, accept_sampled_many
from sluice.engine.model_runner import PagedModel
from sluice.engine.proposer import (
    Draft,
    DraftModelProposer,
    DraftRequest,
    NgramProposer,
    Proposer,
)
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence
from sluice.engine.speculative import AdaptiveK, SpecDecodeStats, SpeculativeConfig

__all__ = ["Speculator"]

# A step whose sequences draft fewer than this share of k each (near their max_tokens or
# the context's end, or prompt lookup finding no match) is not a sample of a step of k's
# cost (measured on the bundled pair: at the end of a batch such steps looked up to half as
# dear, and the cheapest sample is the estimate).
_FULL_PLAN_SHARE = 0.75


class Speculator:
    """Plans, drafts and verifies; keeps :class:`SpecDecodeStats` in ``stats``."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.adaptive_k = (
            AdaptiveK(config.num_speculative_tokens, explore_every=config.explore_every)
            if config.adaptive
            else None
        )
        self.stats = SpecDecodeStats(config.method, config.num_speculative_tokens)
        self._num_caught_up = 0  # of the step in progress
        self._catch_up_s = 0.0  # of the step in progress
        self._cut_short = False  # the step in progress drafts well under its k (see propose)
        self._full_draft = 0  # the step in progress's k times its speculating sequences
        self._context = 0.0  # the step in progress's mean tokens per decoding sequence

    @classmethod
    def build(
        cls,
        config: SpeculativeConfig,
        draft_model: PagedModel | None,
        target: PagedModel,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
    ) -> Speculator:
        """The speculator ``config`` asks for; :class:`ValueError` for a draft model that is
        missing, not wanted, or does not fit the target (vocabulary, positions)."""
        if config.method == "ngram":
            if draft_model is not None:
                raise ValueError("the 'ngram' method takes no draft model")
            return cls(
                config, NgramProposer(ngram_min=config.ngram_min, ngram_max=config.ngram_max)
            )
        if draft_model is None:
            raise ValueError("the 'draft' method needs a draft model")
        if draft_model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_model.config.vocab_size}) is not the "
                f"target's ({target.config.vocab_size})"
            )
        if draft_model.config.n_positions < max_model_len:
            raise ValueError(
                f"the draft model has {draft_model.config.n_positions} positions, "
                f"max_model_len is {max_model_len}"
            )
        return cls(
            config, DraftModelProposer(draft_model, num_blocks=num_blocks, block_size=block_size)
        )

    def plan(
        self, decodes: Sequence_[tuple[Sequence, SamplingParams]], max_model_len: int
    ) -> tuple[dict[int, int], int]:
        """The lookahead each decoding sequence asks for this step, and the step's ``k``:
        room for ``k`` drafts and one more token within ``max_tokens`` and the context."""
        if self.adaptive_k is not None:
            speculating = [seq for seq, params in decodes if params.speculative]
            num_behind = self.proposer.num_behind(speculating)
            self._context = sum(seq.num_tokens for seq, _ in decodes) / max(1, len(decodes))
            k = self.adaptive_k.choose(len(decodes), num_behind, self._context)
        else:
            k = self.config.num_speculative_tokens
        self.stats.last_k = k
        plan: dict[int, int] = {}
        self._cut_short = k > 0  # until its drafts say otherwise (see propose)
        self._full_draft = 0
        if k == 0:
            return plan, k
        for seq, params in decodes:
            if not params.speculative:
                continue
            self._full_draft += k
            room = (
                min(params.max_tokens - seq.num_completion_tokens, max_model_len - seq.num_tokens)
                - 1
            )
            if min(k, room) > 0:
                plan[seq.seq_id] = min(k, room)
        return plan, k

    def propose(self, requests: Sequence_[DraftRequest]) -> dict[int, Draft]:
        """The drafts of ``requests``. One that got lookahead but no draft (prompt lookup
        found no match) counts as a rejection at position 1: adaptive k weighs what a
        step of k is likely to yield, and a missing draft yields nothing."""
        if not requests:
            self._num_caught_up = 0
            return {}
        drafts = self.proposer.propose(requests)
        self._num_caught_up = self.proposer.num_caught_up
        self._catch_up_s = self.proposer.catch_up_s
        # Fewer drafts than k a sequence (sequences near their end, no lookahead blocks,
        # prompt lookup without a match) cost less than a step of k: no measure of one.
        num_drafted = sum(len(draft.token_ids) for draft in drafts.values())
        self._cut_short = num_drafted < _FULL_PLAN_SHARE * self._full_draft
        if self.adaptive_k is not None:
            for _ in range(len(requests) - len(drafts)):
                self.adaptive_k.accepted(1, 0)
        return drafts

    def verify(
        self,
        logits: torch.Tensor,
        draft: Draft,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> tuple[list[int], list[float]]:
        """One sequence's emitted tokens and logprobs; raises for a row that cannot be
        sampled (:class:`~sluice.engine.sampler.NonFiniteLogitsError`)."""
        tokens, logprobs = accept(logits, draft.token_ids, draft.probs, params, generator)
        self._count(len(draft.token_ids), len(tokens) - 1)
        return tokens, logprobs

    def verify_greedy(
        self, rows: Sequence_[tuple[torch.Tensor, Draft]]
    ) -> list[tuple[list[int], list[float]] | Exception]:
        """:meth:`verify` of greedy sequences (each one's logits and draft), in one pass
        (:func:`~sluice.engine.acceptance.accept_greedy_many`); a sequence whose rows cannot
        be sampled gets its exception in its place."""
        if not rows:
            return []
        outcomes = accept_greedy_many(
            torch.cat([logits for logits, _ in rows]), [draft.token_ids for _, draft in rows]
        )
        for (_, draft), outcome in zip(rows, outcomes, strict=True):
            if not isinstance(outcome, Exception):
                self._count(len(draft.token_ids), len(outcome[0]) - 1)
        return list(outcomes)

    def verify_sampled(
        self, rows: Sequence_[tuple[torch.Tensor, Draft, SamplingParams, torch.Generator | None]]
    ) -> list[tuple[list[int], list[float]] | Exception]:
        """:meth:`verify` of sampled sequences (each one's logits, draft, params and
        generator), in one pass (:func:`~sluice.engine.acceptance.accept_sampled_many`); a
        sequence whose rows cannot be sampled gets its exception in its place."""
        if not rows:
            return []
        outcomes = accept_sampled_many(
            torch.cat([logits for logits, *_ in rows]),
            [(draft.token_ids, draft.probs) for _, draft, *_ in rows],
            [params for *_, params, _ in rows],
            [generator for *_, generator in rows],
        )
        for (_, draft, *_), outcome in zip(rows, outcomes, strict=True):
            if not isinstance(outcome, Exception):
                self._count(len(draft.token_ids), len(outcome[0]) - 1)
        return list(outcomes)

    def _count(self, num_drafted: int, num_accepted: int) -> None:
        self.stats.record(num_drafted, num_accepted)
        if self.adaptive_k is not None:
            self.adaptive_k.accepted(num_drafted, num_accepted)

    def observe(self, num_decodes: int, num_prefill_tokens: int, k: int, duration_s: float) -> None:
        """The step ran: its cost counts towards ``k`` when it ran decodes alone, drafted
        about ``k`` tokens a sequence, and its draft model did not catch up on more than a
        token a sequence (a catch-up after steps without drafts costs once, not every step
        at that ``k``)."""
        if self.adaptive_k is None or num_prefill_tokens:
            return
        num_caught_up, self._num_caught_up = self._num_caught_up, 0
        catch_up_s, self._catch_up_s = self._catch_up_s, 0.0
        self.adaptive_k.observe(
            num_decodes,
            k,
            duration_s,
            steady=num_caught_up <= num_decodes and not self._cut_short,
            num_caught_up=num_caught_up,
            catch_up_s=catch_up_s or None,
            context=self._context,
        )

    def forget(self, seq_id: int) -> None:
        self.proposer.forget(seq_id)
