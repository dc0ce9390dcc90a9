"""Who drafts the speculative tokens: prompt lookup, or a small draft model (torch).

A proposer is asked, after the scheduler gave each speculating sequence lookahead slots,
for up to ``num_tokens`` tokens per sequence, and answers with a :class:`Draft`: the tokens
and, when they were sampled, the draft's distributions ``q`` at each (the acceptance rule
needs them; a greedy or deterministic draft has none).

The draft model shares the target's block tables: its own KV cache has the same blocks and
slots, so a sequence's blocks hold both models' K/V and freeing them (finish, abort,
preemption) frees both. The draft computes its K/V only when asked to draft, catching up on
the tokens it has not seen (the prompt, the tokens of steps that did not speculate, the
tokens that replaced its rejected drafts) in one chunk before drafting. It remembers, per
sequence, how far its K/V is valid, and starts over when the sequence got new blocks
(preempted and re-admitted: ``Sequence.num_allocations`` changed).

Its rounds (one token a sequence, at the next position, through the same blocks; the
catch-up too, when it is one token a sequence, as after a rejection) are laid out once per
:meth:`DraftModelProposer.propose` by
:class:`~sluice.engine.models.decode.DecodeRounds` and run by the model's ``decode``, and
greedy drafts stay one tensor a round (the token ids become Python ints once, at the end):
each round is then mostly the draft model's own arithmetic. A float32 GPT-2 draft on the CPU
drafts a step of up to 16 sequences whose catch-ups are short in C instead, greedy or sampled
(:class:`~sluice.engine.models.native_draft.NativeDraft`: every round in one call, writing
the same K/V), since a small draft's rounds are mostly the framework's time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Protocol

import torch

from sluice.engine.model_runner import ModelRunner, ModelSlice, PagedModel
from sluice.engine.models.decode import DecodeRounds
from sluice.engine.models.native_draft import (
    MAX_NATIVE_CATCH_UP_TOKENS,
    MAX_NATIVE_DRAFT_SEQUENCES,
    NativeDraft,
)
from sluice.engine.sampler import draw_tokens, filter_logits
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence
from sluice.engine.speculative import propose_ngram

__all__ = ["Draft", "DraftModelProposer", "DraftRequest", "NgramProposer", "Proposer"]


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One sequence to draft for: at most ``num_tokens`` tokens after its last."""

    seq: Sequence
    num_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None


@dataclass(frozen=True, slots=True)
class Draft:
    """Drafted tokens and, when sampled from the draft model, its ``[k, vocab]`` ``q``."""

    token_ids: tuple[int, ...]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Drafts tokens for the speculating sequences of a step."""

    def propose(self, requests: Sequence_[DraftRequest]) -> dict[int, Draft]: ...

    def forget(self, seq_id: int) -> None: ...

    def num_behind(self, seqs: Sequence_[Sequence]) -> int:
        """Tokens a :meth:`propose` for ``seqs`` would catch up on beyond one a sequence
        (0 for a proposer without a model)."""
        ...

    @property
    def num_caught_up(self) -> int:
        """Tokens the last :meth:`propose` ran beyond one a sequence to catch up (a draft
        model's K/V of tokens it had not seen); 0 for a proposer without a model."""
        ...

    @property
    def catch_up_s(self) -> float:
        """Seconds the last :meth:`propose`'s catch-up pass took (0: none ran)."""
        ...


class NgramProposer:
    """Prompt-lookup drafting (:func:`~sluice.engine.speculative.propose_ngram`)."""

    def __init__(self, *, ngram_min: int = 1, ngram_max: int = 4) -> None:
        self._ngram_min = ngram_min
        self._ngram_max = ngram_max

    def propose(self, requests: Sequence_[DraftRequest]) -> dict[int, Draft]:
        drafts: dict[int, Draft] = {}
        for request in requests:
            tokens = propose_ngram(
                request.seq.token_ids,
                request.num_tokens,
                ngram_min=self._ngram_min,
                ngram_max=self._ngram_max,
            )
            if tokens:
                drafts[request.seq.seq_id] = Draft(tuple(tokens))
        return drafts

    def forget(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""

    def num_behind(self, seqs: Sequence_[Sequence]) -> int:
        return 0

    @property
    def num_caught_up(self) -> int:
        return 0

    @property
    def catch_up_s(self) -> float:
        return 0.0


@dataclass(slots=True)
class _DraftState:
    num_allocations: int
    num_valid: int  # leading tokens whose draft K/V is in the cache
    start: int = 0  # position of the first pending draft
    pending: tuple[int, ...] = ()  # drafts whose K/V the draft wrote, from ``start``


class DraftModelProposer:
    """Drafts with a small model of the target's vocabulary over its own paged cache."""

    def __init__(self, model: PagedModel, *, num_blocks: int, block_size: int) -> None:
        self.runner = ModelRunner(model, model.make_kv_cache(num_blocks, block_size))
        self._native = NativeDraft.for_model(model, self.runner.kv_cache)
        self.vocab_size = model.config.vocab_size
        self.n_positions = model.config.n_positions
        self._states: dict[int, _DraftState] = {}
        self._num_caught_up = 0
        self._catch_up_s = 0.0

    @property
    def num_caught_up(self) -> int:
        return self._num_caught_up

    @property
    def catch_up_s(self) -> float:
        return self._catch_up_s

    def forget(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def num_behind(self, seqs: Sequence_[Sequence]) -> int:
        return sum(
            max(0, seq.num_tokens - 1 - self._num_valid(seq, self._states.get(seq.seq_id)))
            for seq in seqs
        )

    def propose(self, requests: Sequence_[DraftRequest]) -> dict[int, Draft]:
        if not requests:
            self._num_caught_up = 0
            return {}
        slices = [self._catch_up(request) for request in requests]
        self._num_caught_up = sum(len(s.token_ids) - 1 for s in slices)
        self._catch_up_s = 0.0
        q: list[torch.Tensor | None] = [None] * len(requests)  # each one's q, when sampled
        if (
            self._native is not None
            and len(requests) <= MAX_NATIVE_DRAFT_SEQUENCES
            and all(len(s.token_ids) <= MAX_NATIVE_CATCH_UP_TOKENS for s in slices)
        ):
            tokens, native_probs = self._native.draft(
                [s.token_ids for s in slices],
                [s.start_position for s in slices],
                [request.num_tokens for request in requests],
                [request.seq.block_table for request in requests],
                [request.params for request in requests],
                [request.generator for request in requests],
            )
            if native_probs is not None:
                for i, request in enumerate(requests):
                    if not request.params.greedy:
                        q[i] = native_probs[i, : request.num_tokens]
        else:
            with torch.inference_mode():
                tokens, probs = self._draft(requests, slices)
            q = [torch.stack(rows) if rows else None for rows in probs]
        drafts: dict[int, Draft] = {}
        for i, request in enumerate(requests):
            seq = request.seq
            state = self._states[seq.seq_id]
            # K/V was written for every draft but the last.
            state.start, state.pending = seq.num_tokens, tuple(tokens[i][:-1])
            drafts[seq.seq_id] = Draft(tuple(tokens[i]), q[i])
        return drafts

    def _draft(
        self, requests: Sequence_[DraftRequest], slices: Sequence_[ModelSlice]
    ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Each request's drafts and, when sampled, their ``q``. Round ``r`` runs at position
        ``num_tokens - 1 + r``: round 0 the catch-up (a decode when every request has one
        token to catch up on, as after a rejection), round ``r >= 1`` draft ``r``."""
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        num_rounds = max(request.num_tokens for request in requests)
        rounds = DecodeRounds(
            [request.seq.block_table for request in requests],
            [request.seq.num_tokens - 1 for request in requests],
            [request.num_tokens for request in requests],
            self.runner.kv_cache,
            max_positions=self.n_positions,
        )
        if all(len(model_slice.token_ids) == 1 for model_slice in slices):
            last = [model_slice.token_ids[0] for model_slice in slices]
            logits = self.runner.decode(
                torch.tensor(last, device=self.runner.device), rounds.layout(0)
            )
        else:
            started = time.perf_counter()
            logits = self.runner.forward(slices)
            self._catch_up_s = time.perf_counter() - started
        active = list(range(len(requests)))  # the requests of this round, in packed order
        drafted: list[tuple[list[int], torch.Tensor]] = []  # each round's (active, tokens)
        ids = torch.empty(0, dtype=torch.long)
        for round_ in range(num_rounds):
            if round_:
                keep = [row for row, i in enumerate(active) if requests[i].num_tokens > round_]
                if len(keep) < len(active):
                    active = [active[row] for row in keep]
                    ids = ids[torch.tensor(keep, device=ids.device)]
                rows = active if len(active) < len(requests) else None
                logits = self.runner.decode(ids, rounds.layout(round_, rows))
            ids = logits.argmax(dim=-1)
            for row, i in enumerate(active):
                if not requests[i].params.greedy:
                    token, q = self._sample(logits[row], requests[i])
                    ids[row] = token
                    probs[i].append(q)
            drafted.append((active, ids))
        tokens: list[list[int]] = [[] for _ in requests]
        for active, round_ids in drafted:
            for i, token in zip(active, round_ids.tolist(), strict=True):
                tokens[i].append(token)
        return tokens, probs

    def _catch_up(self, request: DraftRequest) -> ModelSlice:
        """The slice that brings the draft's K/V up to the sequence's last token."""
        seq = request.seq
        state = self._states.get(seq.seq_id)
        num_valid = self._num_valid(seq, state)
        if state is None or state.num_allocations != seq.num_allocations:
            state = _DraftState(seq.num_allocations, 0)
            self._states[seq.seq_id] = state
        state.pending = ()
        start = min(num_valid, seq.num_tokens - 1)
        state.num_valid = seq.num_tokens
        return ModelSlice(seq.token_ids[start:], start, seq.block_table)

    @staticmethod
    def _num_valid(seq: Sequence, state: _DraftState | None) -> int:
        """Leading tokens of ``seq`` whose draft K/V is in the cache: those it had, and the
        pending drafts the sequence kept; 0 when it got new blocks since."""
        if state is None or state.num_allocations != seq.num_allocations:
            return 0
        matched = 0
        for draft, actual in zip(state.pending, seq.token_ids[state.start :], strict=False):
            if draft != actual:
                break
            matched += 1
        return max(state.num_valid, state.start + matched) if state.pending else state.num_valid

    @staticmethod
    def _sample(logits: torch.Tensor, request: DraftRequest) -> tuple[int, torch.Tensor]:
        q = torch.softmax(filter_logits(logits, request.params), dim=-1).cpu()
        return int(draw_tokens(q[None], request.generator)[0]), q
