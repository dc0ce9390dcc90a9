"""One engine step's packed inputs, shared by every model: which tokens belong to which
sequence, where their K/V go in the paged cache, and the checks that they fit together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.engine.kv_cache import KVCache, num_blocks_for

__all__ = ["StepError", "StepSequence", "check_step", "last_token_indices", "packed_slots"]


class StepError(ValueError):
    """The packed inputs of a step do not fit together (shapes, slices or block tables)."""


@dataclass(frozen=True)
class StepSequence:
    """One sequence's share of a step's packed tokens.

    ``input_ids[start : start + num_new_tokens]`` are its new tokens; ``context_len`` counts
    the tokens in the cache after this step, new ones included, so the new tokens sit at
    positions ``context_len - num_new_tokens .. context_len - 1``. ``block_table`` must
    cover ``context_len`` positions.
    """

    start: int
    num_new_tokens: int
    context_len: int
    block_table: Sequence[int]

    def __post_init__(self) -> None:
        if self.start < 0:
            raise StepError(f"start must be >= 0, got {self.start}")
        if self.num_new_tokens <= 0:
            raise StepError(f"num_new_tokens must be positive, got {self.num_new_tokens}")
        if self.context_len < self.num_new_tokens:
            raise StepError(
                f"context_len {self.context_len} < num_new_tokens {self.num_new_tokens}"
            )

    @property
    def end(self) -> int:
        """One past the index of its last new token in the packed inputs."""
        return self.start + self.num_new_tokens


def check_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    seqs: Sequence[StepSequence],
    kv_cache: KVCache,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    max_positions: int,
) -> None:
    """Raise :class:`StepError` unless the step's inputs fit the model and the cache."""
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise StepError(
            f"input_ids and positions must be 1-D and equal in shape, got "
            f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
        )
    if not seqs:
        raise StepError("a step needs at least one sequence")
    if kv_cache.num_layers != num_layers:
        raise StepError(f"kv_cache has {kv_cache.num_layers} layers, model has {num_layers}")
    if (kv_cache.num_kv_heads, kv_cache.head_dim) != (num_kv_heads, head_dim):
        raise StepError(
            f"kv_cache holds {kv_cache.num_kv_heads} heads of dim {kv_cache.head_dim}, "
            f"model needs {num_kv_heads} of dim {head_dim}"
        )
    num_packed_tokens = 0
    for index, seq in enumerate(seqs):
        if seq.start != num_packed_tokens:
            raise StepError(f"sequence {index} starts at {seq.start}, expected {num_packed_tokens}")
        if seq.context_len > max_positions:
            raise StepError(
                f"sequence {index} context_len {seq.context_len} exceeds the model's "
                f"{max_positions} positions"
            )
        num_needed_blocks = num_blocks_for(seq.context_len, kv_cache.block_size)
        if len(seq.block_table) < num_needed_blocks:
            raise StepError(
                f"sequence {index} needs {num_needed_blocks} blocks for context_len "
                f"{seq.context_len}, block_table has {len(seq.block_table)}"
            )
        num_packed_tokens = seq.end
    if num_packed_tokens != input_ids.shape[0]:
        raise StepError(
            f"sequences cover {num_packed_tokens} tokens, input_ids has {input_ids.shape[0]}"
        )


def packed_slots(
    positions: torch.Tensor, seqs: Sequence[StepSequence], kv_cache: KVCache
) -> torch.Tensor:
    """The cache slot of every packed token, through its sequence's block table."""
    return torch.cat(
        [kv_cache.slot_mapping(seq.block_table, positions[seq.start : seq.end]) for seq in seqs]
    )


def last_token_indices(seqs: Sequence[StepSequence], device: torch.device) -> torch.Tensor:
    """The packed index of each sequence's last new token (where its logits come from)."""
    return torch.tensor([seq.end - 1 for seq in seqs], device=device)
