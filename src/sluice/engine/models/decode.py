"""Successive decode rounds of the same sequences, laid out once: a draft model drafting.

A draft model drafting ``k`` tokens runs, after its first step, ``k - 1`` steps in which
each sequence decodes one token at the position after its last, through the same block
table. Laying each of them out from scratch (:func:`~sluice.engine.models.step.begin_step`:
the checks, the slots in Python lists, a tensor per field) was a fifth of the bundled
draft's forward on the CPU. :class:`DecodeRounds` checks the rounds and works out their
slots once, as tensors; each round's :class:`~sluice.engine.models.step.StepLayout` is then
a few slices of them, run by a model's ``decode``.

Sequence ``i`` has ``num_rounds[i]`` rounds; its round ``r`` writes the K/V of the token at
position ``first_positions[i] + r`` and attends to positions ``0 .. first_positions[i] +
r``: key slots past a sequence's context read the cache's zero slot and are masked, as in
:class:`~sluice.engine.models.step.AttentionGroup`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.engine.kv_cache import KVCache, num_blocks_for
from sluice.engine.models.native_attention import NativeGroup, load_native_attention
from sluice.engine.models.step import AttentionGroup, StepError, StepLayout

__all__ = ["DecodeRounds"]


class DecodeRounds:
    """The layouts of successive decode steps of the same sequences (module docstring).

    Raises :class:`~sluice.engine.models.step.StepError` when a sequence's last round would
    pass ``max_positions`` or its block table does not cover it.
    """

    def __init__(
        self,
        block_tables: Sequence[Sequence[int]],
        first_positions: Sequence[int],
        num_rounds: Sequence[int],
        kv_cache: KVCache,
        *,
        max_positions: int,
    ) -> None:
        if not block_tables or not len(block_tables) == len(first_positions) == len(num_rounds):
            raise StepError(
                f"need a first position and a number of rounds per block table, got "
                f"{len(first_positions)} and {len(num_rounds)} for {len(block_tables)}"
            )
        if min(num_rounds) < 1:
            raise StepError(f"every sequence needs a round, got {min(num_rounds)}")
        if min(first_positions) < 0:
            raise StepError(f"first positions must be >= 0, got {min(first_positions)}")
        block_size = kv_cache.block_size
        final_contexts = [
            first + count for first, count in zip(first_positions, num_rounds, strict=True)
        ]
        for index, (table, context_len) in enumerate(
            zip(block_tables, final_contexts, strict=True)
        ):
            if context_len > max_positions:
                raise StepError(
                    f"sequence {index} would reach context_len {context_len}, the model has "
                    f"{max_positions} positions"
                )
            if len(table) < num_blocks_for(context_len, block_size):
                raise StepError(
                    f"sequence {index} needs {num_blocks_for(context_len, block_size)} blocks "
                    f"for context_len {context_len}, block_table has {len(table)}"
                )
        device = kv_cache.flat_k[0].device
        n = len(block_tables)
        max_context = max(final_contexts)
        max_blocks = num_blocks_for(max_context, block_size)
        tables = [
            list(table[:max_blocks]) + [0] * (max_blocks - min(max_blocks, len(table)))
            for table in block_tables
        ]
        keys = (
            torch.tensor(tables, dtype=torch.long)[:, :, None] * block_size
            + torch.arange(block_size)
        ).view(n, max_blocks * block_size)[:, :max_context]
        in_context = torch.arange(max_context) < torch.tensor(final_contexts)[:, None]
        self.num_rounds = max(num_rounds)
        self._first_positions = list(first_positions)
        self._num_rounds = list(num_rounds)
        self._zero_slot = kv_cache.zero_slot
        self._device = device
        self._kernel = load_native_attention(kv_cache)
        self._tables = torch.tensor(tables, dtype=torch.long)
        self._all_rows = torch.arange(n, dtype=torch.long)
        # [n, max_context]: the cache slot of each key position, the zero slot past the end.
        self._keys = torch.where(in_context, keys, kv_cache.zero_slot).to(device)
        positions = torch.tensor(first_positions, dtype=torch.long, device=device)
        rounds = torch.arange(self.num_rounds, dtype=torch.long, device=device)
        self._positions = positions[None, :] + rounds[:, None]  # [rounds, n]
        # [rounds, n]: a sequence's write slot in round r is its key slot at that position
        # (past its last round, the last one's: never used, layout() refuses such a round).
        last = torch.tensor(final_contexts, device=device)[None, :] - 1
        self._slots = (
            self._keys.gather(1, torch.minimum(self._positions, last).t()).t().contiguous()
        )

    @property
    def num_seqs(self) -> int:
        return len(self._first_positions)

    def layout(self, round_: int, rows: Sequence[int] | None = None) -> StepLayout:
        """Round ``round_``'s layout for the sequences ``rows`` (indices into the block
        tables, in order; None: all of them), whose packed tokens are in that order."""
        if not 0 <= round_ < self.num_rounds:
            raise StepError(f"round {round_} out of range [0, {self.num_rounds})")
        firsts = self._first_positions
        if any(self._num_rounds[row] <= round_ for row in rows or range(self.num_seqs)):
            raise StepError(f"a sequence of round {round_} has fewer rounds")
        if rows is None:
            contexts = [first + round_ + 1 for first in firsts]
            index, slots = None, self._slots[round_]
            positions = self._positions[round_]
        else:
            if not rows:
                raise StepError("a round needs at least one sequence")
            contexts = [firsts[row] + round_ + 1 for row in rows]
            index = torch.tensor(rows, dtype=torch.long, device=self._device)
            slots = self._slots[round_].index_select(0, index)
            positions = self._positions[round_].index_select(0, index)
        if self._kernel is not None:
            row_seqs = self._all_rows if index is None else index
            native = NativeGroup(
                self._kernel,
                self._all_rows[: len(contexts)],
                row_seqs,
                torch.tensor(contexts, dtype=torch.long),
                self._tables,
            )
            return StepLayout((), positions, slots, (), native)
        keys = self._keys if index is None else self._keys.index_select(0, index)
        max_context = max(contexts)
        keys = keys[:, :max_context]
        mask: torch.Tensor | None = None
        if min(contexts) < max_context:
            in_context = torch.arange(max_context, device=self._device) < torch.tensor(
                contexts, device=self._device
            ).unsqueeze(1)
            keys = torch.where(in_context, keys, self._zero_slot)
            mask = in_context[:, None, None, :]
        group = AttentionGroup(
            len(contexts), 1, max_context, keys.reshape(-1), mask, None, None, None
        )
        return StepLayout((), positions, slots, (group,))
