"""Runs the model over one scheduled batch: packs its tokens, returns the logits it samples from.

The scheduler speaks in sequences and token counts; the model speaks in packed tensors. For
each item of a :class:`~sluice.engine.scheduler.ScheduledBatch` the runner takes the tokens
``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` of its sequence, at those
positions, and describes the slice with a :class:`~sluice.engine.models.step.StepSequence`
whose ``context_len`` is ``num_computed_tokens + num_new_tokens`` and whose ``block_table``
is the sequence's. Logits come back only for the items that sample (a prefill chunk that
stops short of the end of the prompt samples nothing).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sluice.engine.kv_cache import KVCache
from sluice.engine.models.step import StepLayout, StepSequence, decode_layout, long_tensor
from sluice.engine.scheduler import ScheduledBatch, ScheduledSequence
from sluice.engine.sequence import SequenceStatus

__all__ = ["ModelRunner", "ModelSlice", "PagedModel", "PagedModelConfig", "StepLogits"]


class PagedModelConfig(Protocol):
    """The model limits the engine checks requests against."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def n_positions(self) -> int: ...


class PagedModel(Protocol):
    """A decoder run one packed step at a time over a paged KV cache (e.g. GPT-2)."""

    @property
    def config(self) -> PagedModelConfig: ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: Sequence[StepSequence],
        kv_cache: KVCache,
    ) -> torch.Tensor: ...

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: StepLayout,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Logits of every token of a step of decodes laid out by the caller, unchecked."""
        ...

    def make_kv_cache(self, num_blocks: int, block_size: int) -> KVCache: ...


@dataclass(frozen=True, slots=True)
class ModelSlice:
    """Tokens of one sequence to run: ``token_ids`` at positions from ``start_position``,
    their K/V written through ``block_table``; logits of the last ``num_logits``."""

    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    num_logits: int = 1


@dataclass(frozen=True)
class StepLogits(Mapping[int, torch.Tensor]):
    """The next-token logits of a step's sampling items: ``matrix`` ``[n, vocab]``, row ``i``
    of sequence ``seq_ids[i]``; as a mapping, each sequence's ``[vocab]`` row.

    A sampler takes the rows of many sequences at once (:meth:`rows`): when they are the
    step's, in its order (a step of decodes), that is the matrix itself, not 64 views
    stacked back into a copy of it.
    """

    seq_ids: list[int]
    matrix: torch.Tensor
    _index: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {seq_id: i for i, seq_id in enumerate(self.seq_ids)})

    def __getitem__(self, seq_id: int) -> torch.Tensor:
        return self.matrix[self._index[seq_id]]

    def __iter__(self) -> Iterator[int]:
        return iter(self.seq_ids)

    def __len__(self) -> int:
        return len(self.seq_ids)

    def rows(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """``[len(seq_ids), vocab]``: the rows of ``seq_ids``, in that order."""
        if list(seq_ids) == self.seq_ids:
            return self.matrix
        index = torch.tensor([self._index[seq_id] for seq_id in seq_ids], dtype=torch.long)
        return self.matrix.index_select(0, index.to(self.matrix.device))


class ModelRunner:
    """Owns the model and its KV cache; turns a scheduled batch into next-token logits."""

    def __init__(self, model: PagedModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache

    @property
    def device(self) -> torch.device:
        return self.kv_cache.k[0].device

    def run(self, batch: ScheduledBatch) -> StepLogits:
        """Run ``batch``; return the ``[vocab]`` logits row of each sampling item by seq_id.

        Items whose sequence has finished (aborted after ``schedule``) are skipped: their
        blocks are gone.
        """
        items = _live_items(batch)
        if items and all(item.num_new_tokens == 1 and item.samples for item in items):
            logits = self._decode_step(items)
            if logits is not None:
                return StepLogits([item.seq.seq_id for item in items], logits)
        _, logits = self._run_items(items, {})
        seq_ids = [item.seq.seq_id for item in items if item.samples]
        if len(seq_ids) < len(items):  # one row per item: keep the sampling items'
            rows = [row for row, item in enumerate(items) if item.samples]
            logits = logits.index_select(
                0, torch.tensor(rows, dtype=torch.long, device=logits.device)
            )
        return StepLogits(seq_ids, logits)

    def verify(
        self, batch: ScheduledBatch, draft_token_ids: Mapping[int, Sequence[int]]
    ) -> dict[int, torch.Tensor]:
        """Run ``batch`` with each sequence's draft tokens after its new ones; return the
        ``[1 + num_drafts, vocab]`` logits of each sampling item by seq_id (row ``i`` scores
        the token after draft ``i``). Draft K/V go to the slots after the sequence's tokens,
        which the scheduler gave it (``num_lookahead_tokens``)."""
        items = _live_items(batch)
        slices, logits = self._run_items(items, draft_token_ids)
        out: dict[int, torch.Tensor] = {}
        row = 0
        for item, model_slice in zip(items, slices, strict=True):
            if item.samples:
                out[item.seq.seq_id] = logits[row : row + model_slice.num_logits]
            row += model_slice.num_logits
        return out

    def _decode_step(self, items: list[ScheduledSequence]) -> torch.Tensor | None:
        """A step of decodes (each item's one new token, which it samples) laid out by
        :func:`~sluice.engine.models.step.decode_layout`; None where that does not take it."""
        layout = decode_layout(
            [item.seq.block_table for item in items],
            [item.num_computed_tokens + 1 for item in items],
            self.kv_cache,
            max_positions=self.model.config.n_positions,
        )
        if layout is None:
            return None
        input_ids = long_tensor(item.seq.token_ids[item.num_computed_tokens] for item in items)
        with torch.inference_mode():
            return self.model.decode(input_ids, layout.positions, layout, self.kv_cache)

    def _run_items(
        self, items: list[ScheduledSequence], draft_token_ids: Mapping[int, Sequence[int]]
    ) -> tuple[list[ModelSlice], torch.Tensor]:
        """The items' slices (drafts after the new tokens) and the logits of :meth:`forward`
        over them."""
        if not items:
            return [], torch.empty(0, 0)
        slices: list[ModelSlice] = []
        for item in items:
            seq = item.seq
            tokens = seq.token_ids[
                item.num_computed_tokens : item.num_computed_tokens + item.num_new_tokens
            ]
            drafts = draft_token_ids.get(seq.seq_id, ()) if item.samples else ()
            if len(drafts) > item.num_lookahead_tokens:
                raise ValueError(
                    f"sequence {seq.seq_id} has {len(drafts)} draft tokens, "
                    f"{item.num_lookahead_tokens} lookahead slots"
                )
            slices.append(
                ModelSlice(
                    [*tokens, *drafts] if drafts else tokens,
                    item.num_computed_tokens,
                    seq.block_table,
                    num_logits=1 + len(drafts),
                )
            )
        return slices, self.forward(slices)

    def decode(self, input_ids: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """One step of decodes (a token a sequence, ``input_ids`` in ``layout``'s order)
        whose layout the caller made and checked
        (:class:`~sluice.engine.models.decode.DecodeRounds`); ``[num_tokens, vocab]``."""
        if torch.is_inference_mode_enabled():  # a draft's rounds: entering again costs
            return self.model.decode(input_ids, layout.positions, layout, self.kv_cache)
        with torch.inference_mode():
            return self.model.decode(input_ids, layout.positions, layout, self.kv_cache)

    def forward(self, slices: Sequence[ModelSlice]) -> torch.Tensor:
        """Run the model once over ``slices``; ``[sum of num_logits, vocab]`` logits."""
        input_ids: list[int] = []
        positions: list[int] = []
        step_seqs: list[StepSequence] = []
        for model_slice in slices:
            num_new = len(model_slice.token_ids)
            context_len = model_slice.start_position + num_new
            step_seqs.append(
                StepSequence(
                    start=len(input_ids),
                    num_new_tokens=num_new,
                    context_len=context_len,
                    block_table=tuple(model_slice.block_table),
                    num_logits=model_slice.num_logits,
                )
            )
            input_ids.extend(model_slice.token_ids)
            positions.extend(range(model_slice.start_position, context_len))
        with torch.inference_mode():
            logits: torch.Tensor = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                step_seqs,
                self.kv_cache,
            )
        return logits


def _live_items(batch: ScheduledBatch) -> list[ScheduledSequence]:
    """The batch's items whose sequence has not finished (one aborted after ``schedule``
    has no blocks left)."""
    return [item for item in batch.items if item.seq.status is not SequenceStatus.FINISHED]
