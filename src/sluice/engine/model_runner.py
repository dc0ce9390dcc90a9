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

from collections.abc import Sequence
from typing import Protocol

import torch

from sluice.engine.kv_cache import KVCache
from sluice.engine.models.step import StepSequence
from sluice.engine.scheduler import ScheduledBatch
from sluice.engine.sequence import SequenceStatus

__all__ = ["ModelRunner", "PagedModel", "PagedModelConfig"]


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

    def make_kv_cache(self, num_blocks: int, block_size: int) -> KVCache: ...


class ModelRunner:
    """Owns the model and its KV cache; turns a scheduled batch into next-token logits."""

    def __init__(self, model: PagedModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache

    @property
    def device(self) -> torch.device:
        return self.kv_cache.k[0].device

    def run(self, batch: ScheduledBatch) -> dict[int, torch.Tensor]:
        """Run ``batch``; return the ``[vocab]`` logits row of each sampling item by seq_id.

        Items whose sequence has finished (aborted after ``schedule``) are skipped: their
        blocks are gone.
        """
        items = [item for item in batch.items if item.seq.status is not SequenceStatus.FINISHED]
        if not items:
            return {}
        input_ids: list[int] = []
        positions: list[int] = []
        step_seqs: list[StepSequence] = []
        for item in items:
            context_len = item.num_computed_tokens + item.num_new_tokens
            step_seqs.append(
                StepSequence(
                    start=len(input_ids),
                    num_new_tokens=item.num_new_tokens,
                    context_len=context_len,
                    block_table=tuple(item.seq.block_table),
                )
            )
            input_ids.extend(item.seq.token_ids[item.num_computed_tokens : context_len])
            positions.extend(range(item.num_computed_tokens, context_len))
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                step_seqs,
                self.kv_cache,
            )
        return {item.seq.seq_id: logits[row] for row, item in enumerate(items) if item.samples}
